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
        str(path.relative_to(AGENT)) for path in AGENT.rglob("*.py") if package in imports_of(path)
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


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path) -> list[str]:
    """`from x import _name` and `module._name` for a module imported by name: a private
    name used outside the module that defines it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and private(node.attr)
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_module_in_agent_uses_another_modules_private_name() -> None:
    """A name shared between modules is public in the module that owns it."""
    found = {str(p.relative_to(AGENT)): private_imports(p) for p in AGENT.rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(AGENT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def agent_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of agent/ that `path` imports anywhere: at the top, in a function or
    under TYPE_CHECKING (a circle there still ties two modules into one)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:  # `from package import module` names a module
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif target in modules:
                    found.add(target)
    found.discard(name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_cycle_in_agent() -> None:
    """Modules of agent/ import each other in one direction only: a circle makes two
    modules one, which neither says."""
    paths = {module_name(p): p for p in AGENT.rglob("*.py")}
    modules = set(paths)
    graph = {name: agent_imports(path, modules) for name, path in paths.items()}
    assert graph["agent.dataplane.ebpf.plan"] >= {
        "agent.dataplane.ebpf.maps", "agent.dataplane.ebpf.translate",
    }  # fmt: skip
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def absolute_imports(path: Path, text: str | None = None) -> set[str]:
    """Every module `path` (a file of the checkout: agent/, bench/, tests/), or `text` as
    if it were that module, imports, relative imports resolved (`from ..config import X`
    in agent/dataplane/select.py is agent.config), and each imported name as a possible
    module (`from .. import config` is agent.config)."""
    package = list(path.relative_to(AGENT.parent).parent.parts)
    found: set[str] = set()
    source = path.read_text(encoding="utf-8") if text is None else text
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_dataplane_module_imports_the_settings_or_the_cli() -> None:
    """Kernel-facing code takes its options as typed objects declared beside it
    (agent/dataplane/options.py); agent.config composes them into flags, never the
    other way round."""
    for path in (AGENT / "dataplane").rglob("*.py"):
        settings = {m for m in absolute_imports(path)
                    if m.split(".")[:2] in (["agent", "config"], ["agent", "cli"])}  # fmt: skip
        assert not settings, f"{path.relative_to(AGENT)} imports {sorted(settings)}"


def test_the_import_check_resolves_relative_imports() -> None:
    """The check above sees every spelling of an import of agent.config or agent.cli."""
    module = AGENT / "dataplane" / "ebpf" / "any.py"
    for text in ["from ...config import Settings", "from ... import config",
                 "import agent.config", "from agent.cli import main",
                 "def f():\n    from ...cli import main"]:  # fmt: skip
        imported = absolute_imports(module, text)
        assert {"agent.config", "agent.cli", "agent.config.Settings"} & imported, text
    assert "agent.config" not in absolute_imports(module, "from ..options import option")
