"""The pure model: Kubernetes objects as plain values, the compiler, and NodeState.

Nothing here does I/O or imports a client library; sources feed it and dataplanes
consume its output.
"""

from .compile import CompileOptions, Compiler, compile
from .decode import Decoded, decode_object
from .nodestate import NodeState
from .types import ClusterState

__all__ = [
    "ClusterState",
    "CompileOptions",
    "Compiler",
    "Decoded",
    "NodeState",
    "compile",
    "decode_object",
]
