"""The Kubernetes API source: configuration and list/watch into the StateStore.

This package is the only code that imports the `kubernetes` client.
"""

from .config import ConfigError, load_config, make_client
from .source import RESOURCES, KubernetesSource, Resource, service_selector

__all__ = [
    "RESOURCES",
    "ConfigError",
    "KubernetesSource",
    "Resource",
    "load_config",
    "make_client",
    "service_selector",
]
