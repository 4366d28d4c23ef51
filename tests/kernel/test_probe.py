"""The eBPF probes and dataplane selection against this kernel (6.18: every probe passes),
a probe made to fail reporting its name and why, and `kube-bpf-proxy cleanup` removing
what both dataplanes installed in a throw-away namespace.

Everything happens in namespaces the tests make (the clsact probe's own, or the `netns`
fixture's) and under a fresh bpffs directory; the machine's own interfaces, rules and the
default pin directory are never touched.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.dataplane import probe
from agent.dataplane.ebpf import libbpf
from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.maps import MapSizes
from agent.dataplane.ebpf.netlink import TcAttacher
from agent.dataplane.ebpf.options import EbpfOptions

ROOT = Path(__file__).parents[2]
POD_INTERFACES = ("vethkbp*",)
# Small maps: the tests need few entries and load faster.
SMALL_MAPS = MapSizes(services=1024, slots=4096, backends=1024, ct=4096, affinity=1024)
SMALL_MAP_FLAGS = [
    "--map-size-services", "1024", "--map-size-slots", "4096", "--map-size-backends", "1024",
    "--map-size-ct", "4096", "--map-size-affinity", "1024",
]  # fmt: skip


def in_netns(name: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{name}", "--", *argv],
        cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def host_view() -> tuple[str, list[str]]:
    """What the clsact probe must not change: the host's `lo` and its clsact qdiscs
    (other tests may add and remove interfaces meanwhile, so not the whole list)."""
    lo = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                        check=True)  # fmt: skip
    every = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True)
    return lo.stdout, [line for line in every.stdout.splitlines() if "clsact" in line]


# --- the probes pass here -------------------------------------------------------------------


def test_the_bpf_syscall_probe_passes_on_this_kernel() -> None:
    assert str(probe.probe_bpf_syscall()) == "bpf-syscall: ok"


def test_the_clsact_probe_passes_and_leaves_the_host_untouched() -> None:
    before = host_view()
    assert str(probe.probe_clsact()) == "clsact: ok"
    assert host_view() == before


def test_every_probe_passes_and_hands_back_a_working_ebpf_dataplane(
    netns: Callable[[], str], bpf_pin_dir: Path
) -> None:
    node = netns()  # the dataplane attaches to this namespace's interfaces (there are none)
    dataplane, results = probe.probe_ebpf(
        lambda: EbpfDataplane(EbpfOptions(bpf_pin_dir, POD_INTERFACES, SMALL_MAPS, netns=node,
                                          watch=False))
    )
    try:
        assert [str(r) for r in results] == ["bpf-syscall: ok", "clsact: ok", "bcc-compile: ok"]
        assert isinstance(dataplane, EbpfDataplane)
        assert sorted(p.name for p in bpf_pin_dir.iterdir() if p.name.startswith("kbp_"))
    finally:
        if dataplane is not None:
            dataplane.cleanup()
            dataplane.close()


# --- a failing probe says which and why ----------------------------------------------------


def test_a_refused_bpf_syscall_is_reported_with_the_probe_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> int:  # as libbpf 1.x fails: -errno, and errno set
        libbpf.ffi.errno = errno.EPERM
        return -errno.EPERM

    monkeypatch.setattr(libbpf, "lib", lambda: SimpleNamespace(bpf_prog_load=refuse))
    dataplane, results = probe.probe_ebpf(lambda: pytest.fail("built after a failed probe"))
    assert dataplane is None
    assert [str(r) for r in results] == [
        "bpf-syscall: EPERM: Operation not permitted (no CAP_BPF?)"
    ]


def test_the_clsact_probe_refuses_to_run_in_the_hosts_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = host_view()
    monkeypatch.setattr(probe, "_CLONE_NEWNET", 0)  # unshare(0) succeeds and moves nothing
    result = probe.probe_clsact()
    assert str(result) == (
        "clsact: unshare left the probe in this process's namespace; refusing to touch it"
    )
    assert host_view() == before


def test_a_build_that_cannot_pin_fails_the_bcc_compile_probe(
    netns: Callable[[], str], tmp_path: Path
) -> None:
    node = netns()
    not_bpffs = tmp_path / "pins"  # tmpfs: pinning the maps fails
    dataplane, results = probe.probe_ebpf(
        lambda: EbpfDataplane(EbpfOptions(not_bpffs, POD_INTERFACES, SMALL_MAPS, netns=node,
                                          watch=False))
    )
    assert dataplane is None
    assert [r.name for r in results] == [probe.BPF_SYSCALL, probe.CLSACT, probe.BCC_COMPILE]
    assert str(results[-1]).startswith("bcc-compile: load: "), results[-1]


# --- the filesystems under the dataplane: bpffs and cgroup2 -------------------------------
#
# Each case runs in a private mount namespace (unshare --mount --propagation private) whose
# changes (a tmpfs over /sys/fs/bpf, a cgroup2 mount somewhere unusual, no cgroup2 at
# all) vanish with it; the machine's own mounts never change.

PROBE_BPFFS = """import json, sys
from pathlib import Path
from agent.dataplane import mounts, probe
pin_dir = Path(sys.argv[1])
result = probe.probe_bpffs(pin_dir)
print(json.dumps({"result": str(result), "fstype": mounts.filesystem_of(pin_dir).fstype}))
"""


def in_private_mounts(
    setup: str, *argv: str, teardown: str = ":", netns: str | None = None
) -> dict:
    """Run the shell `setup`, then argv, then `teardown` in a new private mount namespace
    (and in netns, if given); argv's last line of output is JSON."""
    script = f'{setup} || exit 97\n"$@"\nstatus=$?\n{teardown}\nexit $status'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
               *argv]  # fmt: skip
    if netns is not None:
        command = ["nsenter", f"--net=/run/netns/{netns}", "--", *command]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_a_bpffs_the_probe_mounts_one_at_the_pin_directorys_parent() -> None:
    """As under `ip netns exec` (which remounts /sys) or on a host without systemd."""
    setup = "mount -t tmpfs kbp-test /sys/fs/bpf"
    report = in_private_mounts(setup, sys.executable, "-c", PROBE_BPFFS, "/sys/fs/bpf/kbp-test")
    assert report == {"result": "bpffs: ok", "fstype": "bpf"}


def test_a_bpffs_that_cannot_be_mounted_fails_the_probe_with_what_to_mount() -> None:
    setup = "mount -t tmpfs kbp-test /sys/fs/bpf"
    no_sys_admin = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]
    report = in_private_mounts(setup, *no_sys_admin, sys.executable, "-c", PROBE_BPFFS,
                               "/sys/fs/bpf/kbp-test")  # fmt: skip
    assert report["fstype"] == "tmpfs"
    assert report["result"] == (
        "bpffs: /sys/fs/bpf is not a BPF filesystem (it is tmpfs mounted at /sys/fs/bpf) and "
        "mounting one there failed with EPERM (no CAP_SYS_ADMIN?): mount it on the node with "
        "`mount -t bpf bpf /sys/fs/bpf`"
    )


BUILD_EBPF = """import json, sys
from agent.config import Settings
from agent.dataplane.select import build_ebpf
settings = Settings(dataplane="ebpf", bpffs=sys.argv[1], pod_interfaces=["vethkbp*"],
                    cgroup_root=sys.argv[2], map_size_services=1024, map_size_slots=4096,
                    map_size_backends=1024, map_size_ct=4096, map_size_affinity=1024)
dataplane = build_ebpf(settings.dataplane_options())
try:
    print(json.dumps(dataplane.status_details()["socketHooks"]))
finally:
    dataplane.cleanup()
"""


def test_socket_hooks_attach_to_a_cgroup2_mounted_at_an_unusual_path(
    netns: Callable[[], str], bpf_pin_dir: Path, tmp_path: Path
) -> None:
    # The cgroup2 mount is the machine's one hierarchy: a name of this run's own, so two
    # suites running at once do not make (and remove) the same cgroup.
    mount = tmp_path / "cgroups"
    cgroup = mount / "unified" / f"kbp-test-{os.getpid()}"
    setup = (f"mkdir -p {mount} && mount -t tmpfs kbp-test {mount} && "
             f"mkdir {mount}/unified && mount -t cgroup2 none {mount}/unified && "
             f"mkdir {cgroup}")  # fmt: skip
    report = in_private_mounts(setup, sys.executable, "-c", BUILD_EBPF, str(bpf_pin_dir),
                               str(cgroup), teardown=f"rmdir {cgroup}", netns=netns())  # fmt: skip
    assert report == {"cgroup": str(cgroup), "state": "attached", "socketLb": "all",
                      "pods": 0, "podsPending": []}  # fmt: skip


def test_without_any_cgroup2_the_ebpf_dataplane_runs_without_socket_hooks(
    netns: Callable[[], str], bpf_pin_dir: Path
) -> None:
    """A cgroup v1 node: the rest of the eBPF dataplane runs; only the socket hooks
    (the node's own processes) are off, and /state says so."""
    hide = "for m in $(awk '$3 == \"cgroup2\" {print $2}' /proc/self/mounts); do umount -l $m; done"
    report = in_private_mounts(hide, sys.executable, "-c", BUILD_EBPF, str(bpf_pin_dir), "auto",
                               netns=netns())  # fmt: skip
    assert report == {"cgroup": None, "state": "off", "socketLb": "all", "pods": 0,
                      "podsPending": []}  # fmt: skip


# --- the agent: selection end to end, and cleanup ----------------------------------------


def test_auto_selects_ebpf_here_and_publishes_why(
    netns: Callable[[], str], bpf_pin_dir: Path
) -> None:
    node = netns()
    assert in_netns(node, "ip", "link", "set", "lo", "up").returncode == 0
    agent = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{node}", "--", sys.executable, "-m", "agent", "run",
         "--manifests", "examples", "--node", "node-a", "--dataplane", "auto",
         "--pod-interfaces", ",".join(POD_INTERFACES), "--bpffs", str(bpf_pin_dir),
         "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0",
         *SMALL_MAP_FLAGS],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = threading.Timer(120, agent.kill)  # a hung start fails rather than blocks
    deadline.start()
    lines: list[str] = []
    try:
        assert agent.stderr is not None
        for line in agent.stderr:
            lines.append(line.rstrip())
            if "serving metrics and /state on" in line:
                break
        log = "\n".join(lines)
        assert "dataplane: ebpf (eBPF probes passed)" in log, log
        url = lines[-1].split("serving metrics and /state on ", 1)[1].split(",", 1)[0].strip()
        fetch = (
            "import sys, urllib.request; "
            "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        )
        state = in_netns(node, sys.executable, "-c", fetch, f"{url}/state")
        assert state.returncode == 0, state.stderr
        status = json.loads(state.stdout)["status"]
        assert (status["dataplane"], status["dataplaneReason"]) == ("ebpf", "eBPF probes passed")
        metrics = in_netns(node, sys.executable, "-c", fetch, f"{url}/metrics").stdout
        assert 'kbp_dataplane_info{dataplane="ebpf",reason="eBPF probes passed"} 1.0' in metrics
    finally:
        deadline.cancel()
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        in_netns(node, sys.executable, "-m", "agent", "cleanup", "--bpffs", str(bpf_pin_dir))


# Rules an earlier iptables agent left, next to another program's rules that must stay.
IPTABLES_LEFTOVERS = """\
*nat
:KBP-SERVICES - [0:0]
:KBP-SVC-TEST - [0:0]
:OTHER-CHAIN - [0:0]
-A PREROUTING -j KBP-SERVICES
-A PREROUTING -j OTHER-CHAIN
-A KBP-SERVICES -d 10.96.0.80/32 -p tcp -m tcp --dport 80 -j KBP-SVC-TEST
-A KBP-SVC-TEST -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A OTHER-CHAIN -d 192.0.2.1/32 -j RETURN
COMMIT
"""
# Only chains, no jump into them from a built-in chain.
KBP_CHAINS_ONLY = """\
*nat
:KBP-SERVICES - [0:0]
:KBP-SVC-TEST - [0:0]
-A KBP-SERVICES -j KBP-SVC-TEST
COMMIT
"""
# What an nftables agent left, next to another program's table that must stay.
NFTABLES_LEFTOVERS = """\
add table ip kube-bpf-proxy
add chain ip kube-bpf-proxy nat-prerouting { type nat hook prerouting priority dstnat ; }
add table ip other-program
add chain ip other-program input { type filter hook input priority filter ; }
"""
IP6TABLES_LEFTOVERS = """\
*nat
:KBP-SERVICES - [0:0]
-A OUTPUT -j KBP-SERVICES
COMMIT
"""


def test_cleanup_removes_what_either_dataplane_installed(
    netns: Callable[[], str], bpf_pin_dir: Path
) -> None:
    node = netns()
    restored = in_netns(node, "iptables-restore", "--noflush", stdin=IPTABLES_LEFTOVERS)
    assert restored.returncode == 0, restored.stderr
    restored = in_netns(node, "ip6tables-restore", "--noflush", stdin=IP6TABLES_LEFTOVERS)
    assert restored.returncode == 0, restored.stderr
    restored = in_netns(node, "nft", "-f", "-", stdin=NFTABLES_LEFTOVERS)
    assert restored.returncode == 0, restored.stderr
    # What an eBPF agent leaves: a kbp_ filter on an interface and a kbp_ pin.
    fd = probe.load_trivial_program()
    try:
        libbpf.obj_pin(fd, str(bpf_pin_dir / "kbp_probe_test"))
        with TcAttacher(node) as attacher:
            assert attacher.attach(1, "ingress", fd, "kbp_probe")  # lo is index 1
    finally:
        os.close(fd)

    done = in_netns(node, sys.executable, "-m", "agent", "cleanup", "--bpffs", str(bpf_pin_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ebpf: detached from 1 interface(s); removed 1 pin(s) under {bpf_pin_dir}" in (
        done.stdout
    )
    assert "iptables (nft): removed" in done.stdout
    assert "nftables: removed table ip kube-bpf-proxy" in done.stdout
    for save in ("iptables-save", "ip6tables-save"):
        rules = in_netns(node, save).stdout
        assert "KBP-" not in rules, f"{save}:\n{rules}"
    tables = in_netns(node, "nft", "list", "tables").stdout
    assert "kube-bpf-proxy" not in tables and "table ip other-program" in tables, tables
    others = in_netns(node, "iptables-save", "-t", "nat").stdout
    assert "-A PREROUTING -j OTHER-CHAIN" in others and "OTHER-CHAIN -d 192.0.2.1" in others
    assert "kbp_" not in in_netns(node, "tc", "filter", "show", "dev", "lo", "ingress").stdout
    assert not (bpf_pin_dir / "kbp_probe_test").exists()


def test_a_failing_cleanup_part_still_runs_the_other_and_exits_1(
    netns: Callable[[], str], tmp_path: Path
) -> None:
    node = netns()
    restored = in_netns(node, "iptables-restore", "--noflush", stdin=KBP_CHAINS_ONLY)
    assert restored.returncode == 0, restored.stderr
    pins = tmp_path / "pins"
    (pins / "kbp_not_a_pin").mkdir(parents=True)  # a directory: unlinking it fails
    done = in_netns(node, sys.executable, "-m", "agent", "cleanup", "--bpffs", str(pins))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "kube-bpf-proxy cleanup: ebpf:" in done.stderr and "kbp_not_a_pin" in done.stderr
    assert "iptables (nft): removed" in done.stdout
    assert "KBP-" not in in_netns(node, "iptables-save").stdout
