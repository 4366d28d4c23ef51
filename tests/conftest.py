"""Shared pytest plumbing for kernel tests.

Tests marked ``@pytest.mark.kernel``, and every test under ``tests/kernel/``, need root,
BPF and network namespaces. Their prerequisites are checked once per session:

* euid 0
* bpffs at ``/sys/fs/bpf`` (mounted here when it is not yet)
* ``import bcc`` (Debian's python3-bpfcc; the venv has ``--system-site-packages``)
* ``bpftool``, ``ip``, ``tc`` and ``nsenter`` on PATH
* ``ip netns`` able to add and delete a namespace
* kernel BTF at ``/sys/kernel/btf/vmlinux``

A missing prerequisite skips the test with the precise reason, except when
``KBP_REQUIRE_KERNEL=1`` (set by ``.ci/run``): then the same reason fails it.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import site
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

KERNEL_TESTS_DIR = Path(__file__).parent / "kernel"

# Agents the tests start never attach socket hooks to the machine's own cgroups (the
# default, --cgroup-root auto, is the cgroup2 root): tests that exercise the hooks pass a
# cgroup of their own with --cgroup-root, which wins over this variable.
os.environ.setdefault("KBP_CGROUP_ROOT", "none")
# The eBPF dataplane remembers the texts that compiled in its trial compile (see
# agent/dataplane/ebpf/kernel.py) as files: in a directory of this run's own, not in the
# machine's /run.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="kbp-test-compiled-")
os.environ.setdefault("KBP_COMPILE_CACHE_DIR", _COMPILE_CACHE)
atexit.register(shutil.rmtree, _COMPILE_CACHE, True)
# The node locks of the agents and cleanups the tests start (one per --bpffs): in a
# directory of this run's own, so a run neither needs the machine's /run nor waits for
# another run's agents on the default --bpffs (tests of the lock pass --lock-dir).
_LOCK_DIR = tempfile.mkdtemp(prefix="kbp-test-locks-")
os.environ.setdefault("KBP_LOCK_DIR", _LOCK_DIR)
atexit.register(shutil.rmtree, _LOCK_DIR, True)
BPFFS = Path("/sys/fs/bpf")
VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")


def _system_packages_are_third_party() -> None:
    """Hypothesis draws constants from the source of every imported module it takes for
    the project's own: whatever lies outside the venv's site-packages and the standard
    library. The venv sees Debian's packages (--system-site-packages), so it parsed
    bcc's source from /usr/lib/python3/dist-packages, whose line 749 has an invalid
    escape (`'\\.'`): a DeprecationWarning `<unknown>:749` in a run without Hypothesis's
    cache, and bcc's constants in our strategies. Those directories hold third-party
    code; Hypothesis keeps the list in a set of its own, which we extend."""
    try:
        from hypothesis.internal import constants_ast, scrutineer
    except ImportError:
        return
    known = getattr(scrutineer, "SITE_PACKAGES_DIRS", None)
    if not isinstance(known, set):
        return
    known.update(Path(p).resolve() for p in site.getsitepackages() if os.path.isdir(p))
    for cached in (scrutineer.ModuleLocation.from_path, constants_ast.is_local_module_file):
        getattr(cached, "cache_clear", lambda: None)()


_system_packages_are_third_party()


def kernel_required() -> bool:
    """True when missing kernel prerequisites must fail tests instead of skipping them."""
    return os.environ.get("KBP_REQUIRE_KERNEL") == "1"


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test for a missing prerequisite, or fail it under KBP_REQUIRE_KERNEL=1."""
    if kernel_required():
        pytest.fail(f"{reason} (KBP_REQUIRE_KERNEL=1)", pytrace=False)
    pytest.skip(reason)


def require_iptables(netns: str) -> None:
    """Skip (or fail) the test when iptables does not work in the namespace."""
    from agent.dataplane.iptables.dataplane import unavailable_reason

    if (reason := unavailable_reason(netns)) is not None:
        skip_or_fail(f"iptables unavailable: {reason}")


def require_nftables(netns: str) -> None:
    """Skip (or fail) the test when nftables does not work in the namespace."""
    from agent.dataplane.nftables.dataplane import unavailable_reason

    if (reason := unavailable_reason(netns)) is not None:
        skip_or_fail(f"nftables unavailable: {reason}")


def _run(*argv: str) -> str | None:
    """Run a command; None on success, else a one-line description of the failure."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        return f"`{' '.join(argv)}` failed: {exc}"
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        return f"`{' '.join(argv)}` exited {proc.returncode}: {detail[-1] if detail else ''}"
    return None


def _check_bpffs() -> str | None:
    if os.path.ismount(BPFFS):
        return None
    error = _run("mount", "-t", "bpf", "bpf", str(BPFFS))
    return None if error is None else f"{BPFFS} is not a bpffs and cannot be mounted: {error}"


def _check_bcc() -> str | None:
    try:
        import bcc  # noqa: F401
    except Exception as exc:
        return f"`import bcc` failed ({type(exc).__name__}: {exc}); install python3-bpfcc"
    return None


def _check_netns() -> str | None:
    name = f"kbp-probe-{os.getpid()}"
    error = _run("ip", "netns", "add", name)
    if error is None:
        error = _run("ip", "netns", "delete", name)
    return None if error is None else f"ip netns does not work: {error}"


@functools.cache
def missing_kernel_prerequisites() -> tuple[str, ...]:
    """Reasons the kernel tests cannot run here; empty when they can. Checked once."""
    if os.geteuid() != 0:
        return (f"kernel tests need root (euid is {os.geteuid()})",)
    tools = ("bpftool", "ip", "tc", "nsenter")
    missing = [f"`{tool}` not on PATH" for tool in tools if not shutil.which(tool)]
    if not VMLINUX_BTF.exists():
        missing.append(f"no kernel BTF ({VMLINUX_BTF} missing)")
    for check in (_check_bpffs, _check_bcc, _check_netns):
        if (reason := check()) is not None:
            missing.append(reason)
    return tuple(missing)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/kernel/ is a kernel test, marked or not."""
    for item in items:
        if KERNEL_TESTS_DIR in item.path.parents:
            item.add_marker(pytest.mark.kernel)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, under KBP_REQUIRE_KERNEL=1, fail) kernel tests lacking prerequisites."""
    if item.get_closest_marker("kernel") is None:
        return
    missing = missing_kernel_prerequisites()
    if not missing:
        return
    skip_or_fail("kernel prerequisites missing: " + "; ".join(missing))


# Fixtures for kernel tests. Names carry the pid so parallel runs never collide, and
# teardown removes everything the test made, also when it failed.

_names = itertools.count()


@pytest.fixture
def netns() -> Iterator[Callable[[], str]]:
    """Factory: each call adds a fresh network namespace and returns its name."""
    made: list[str] = []

    def make() -> str:
        name = f"kbp-test-{os.getpid()}-{next(_names)}"
        subprocess.run(["ip", "netns", "add", name], check=True)
        made.append(name)
        return name

    yield make
    for name in reversed(made):
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.fixture
def bpf_pin_dir() -> Iterator[Path]:
    """A fresh directory on bpffs for a test's pins; removed with its pins afterwards."""
    path = BPFFS / f"kbp-test-{os.getpid()}-{next(_names)}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
