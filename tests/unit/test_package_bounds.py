"""Where things live: the lab and explain ask the model's outcome oracle and import neither
each other nor anything that climbs back up; the shipped package holds no test or bench
scaffolding; no bench script imports another (shared parts live in bench/common/)."""

from __future__ import annotations

from pathlib import Path

from .test_layers import absolute_imports

ROOT = Path(__file__).parents[2]
AGENT = ROOT / "agent"
BENCH = ROOT / "bench"


def imports_under(package: str) -> dict[str, set[str]]:
    folder = ROOT / package.replace(".", "/")
    return {str(path.relative_to(ROOT)): absolute_imports(path) for path in folder.rglob("*.py")}


def test_the_lab_and_explain_do_not_import_each_other() -> None:
    for importer, other in (("agent.lab", "agent.explain"), ("agent.explain", "agent.lab")):
        found = {
            path: sorted(m for m in modules if m == other or m.startswith(other + "."))
            for path, modules in imports_under(importer).items()
        }
        assert {path: names for path, names in found.items() if names} == {}, importer


def test_the_outcome_oracle_asks_only_the_model() -> None:
    """The oracle explain, the lab and the tests ask lives in the model and asks nobody."""
    modules = absolute_imports(AGENT / "model" / "outcome.py")
    assert sorted(m for m in modules if m.startswith("agent.")) == [
        m for m in sorted(modules) if m.startswith("agent.model.")
    ]


def test_the_shipped_package_imports_no_test_or_bench_module() -> None:
    for path, modules in imports_under("agent").items():
        assert not any(m.split(".")[0] in ("tests", "bench") for m in modules), path


def test_the_test_only_lab_is_outside_the_shipped_package() -> None:
    assert not (AGENT / "lab" / "nodelab.py").exists()
    assert (ROOT / "tests" / "lab" / "nodelab.py").exists()


def test_no_bench_script_imports_another() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"}
    found = {}
    for path in [*BENCH.glob("*.py"), *(BENCH / "common").glob("*.py")]:
        name = str(path.relative_to(ROOT))
        others = sorted(
            m
            for m in absolute_imports(path)
            if m.startswith("bench.") and m.split(".")[1] in scripts
        )
        if others:
            found[name] = others
    assert found == {}
