"""One module imports each heavy dependency: exactly one module imports bcc, exactly
one imports pyroute2, only agent/k8s/ imports kubernetes, and the model imports none of
them nor any dataplane."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).parents[2] / "agent"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def importers(package: str) -> set[str]:
    return {
        str(path.relative_to(AGENT))
        for path in AGENT.rglob("*.py")
        if package in imports_of(path)
    }


def test_only_the_loader_imports_bcc() -> None:
    assert importers("bcc") == {"dataplane/ebpf/kernel.py"}


def test_only_the_netlink_module_imports_pyroute2() -> None:
    assert importers("pyroute2") == {"dataplane/ebpf/netlink.py"}


def test_only_the_k8s_package_imports_kubernetes() -> None:
    assert {path.split("/")[0] for path in importers("kubernetes")} == {"k8s"}


def test_the_model_imports_no_dataplane_or_heavy_dependency() -> None:
    for path in (AGENT / "model").rglob("*.py"):
        assert not imports_of(path) & {"bcc", "pyroute2", "kubernetes", "cffi"}, path
        tree = ast.parse(path.read_text(encoding="utf-8"))
        relative = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any("dataplane" in module for module in relative), path
