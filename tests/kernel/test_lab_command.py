"""`kube-bpf-proxy lab` as a user runs it (`make lab`): a subprocess that builds the example
cluster in namespaces, runs the agents, checks every Service and removes everything; and
`lab --keep` followed by `lab down`.

Address plan: examples/README.md (nodes 192.0.2.10-12, pods 10.244.<node>.0/24, clients
10.244.<node>.254, ClusterIPs 10.96.0.0/16, ExternalIP 203.0.113.7, VIP 203.0.113.9); the
outside client is 192.0.2.100 and 2001:db8::100. Each test finds its run's namespaces, pins
and processes by the run id the lab prints, so other labs on the machine are left alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.lab.expect import TIMES
from agent.lab.netns import Run, namespaces_of, pids_in, pin_dirs_of, remove_run

# Slow (each test runs `kube-bpf-proxy lab`, limited to 600 s a run; one runs it twice):
# `-m 'not slow'` leaves these out.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).parents[2]
RUN_LINE = re.compile(r"^kube-bpf-proxy lab (r[0-9a-f]{4}):", re.MULTILINE)


def lab(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBP_")}
    return subprocess.run(
        [sys.executable, "-m", "agent", "lab", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip


def run_of(output: str) -> Run:
    match = RUN_LINE.search(output)
    assert match, output
    return Run(match.group(1))


def agents_of(run: Run) -> list[int]:
    """Agent processes still running with this run's pin directories."""
    marker = f"kube-bpf-proxy-lab-{run.id}-".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def assert_nothing_left(run: Run) -> None:
    assert namespaces_of(run) == []
    assert pin_dirs_of(run) == []
    assert not run.workdir.exists()
    assert agents_of(run) == []


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Runs a test started; whatever a failing test left of them is removed."""
    started: list[Run] = []
    yield started
    for run in started:
        remove_run(run)


def check_rows(output: str) -> None:
    x = TIMES
    rows = {
        "plain ClusterIP": rf"ClusterIP 10\.96\.0\.10:80/TCP +clusterBackends +web-a web-b +"
                           rf"web-a{x}\d+ web-b{x}\d+ +✔",
        "sessionAffinity": rf"ClusterIP 10\.96\.0\.11:80/TCP +clusterBackends +sticky-a sticky-b"
                           rf" sticky-c +sticky-[abc]{x}20 +✔",
        "internalTrafficPolicy Local": rf"ClusterIP 10\.96\.0\.12:53/UDP +localBackends +"
                                       rf"default/dns-cache-a +default/dns-cache-a{x}20 +✔",
        "ITP Local dropping on node-b": rf"ClusterIP 10\.96\.0\.12:53/UDP +localBackends \(empty"
                                        rf"\) +dropped \(endpoints elsewhere\) +timeout{x}3 +✔",
        "zone hints from node-c": rf"ClusterIP 10\.96\.0\.15:9090/TCP +clusterBackends +catalog-"
                                  rf"c +catalog-c{x}20 +✔",
        "LocalFirst": rf"ClusterIP 10\.96\.0\.18:80/TCP +clusterBackends +search-b +search-b{x}20"
                      rf" +✔",
        "maglev UDP": rf"ClusterIP 10\.96\.0\.53:53/UDP .* dns-cache-c{x}\d+ +✔",
        "IPv6": r"ClusterIP \[fd00:96::17\]:80/TCP +clusterBackends +api-a api-b .* +✔",
        "headless": r"ml/llm-0 +headless: not proxied \(as kube-proxy\)",
        "NodePort under ETP Local from a pod": rf"NodePort 192\.0\.2\.10:30090/TCP +clusterBack"
                                               rf"ends \(from a pod\) +admin-b +admin-b{x}20 +✔",
    }  # fmt: skip
    for what, pattern in rows.items():
        assert re.search(pattern, output), f"{what}: no row matching {pattern!r}:\n{output}"


def check_outside_rows(output: str, dataplane: str) -> None:
    """The outside client's table: every external frontend of node-a answered by the pods
    its policy promises, each seeing the source address the dataplane promises."""
    assert re.search(r"^from outside \(192\.0\.2\.100, 2001:db8::100 → node-a; dataplane "
                     rf"{dataplane}\)", output, re.MULTILINE), output  # fmt: skip
    section = output[output.index("\nfrom outside (") :].split("\n\n", 1)[0]
    x = TIMES
    # eBPF translates only the destination to a pod on node-a; iptables and nftables
    # masquerade all.
    api_a = "client" if dataplane == "ebpf" else "node-a"
    rows = {
        "NodePort, Cluster policy, a backend on each node": (
            rf"NodePort 192\.0\.2\.10:30017/TCP +clusterBackends \(from outside\) +api-a api-b +"
            rf"api-a{x}\d+ api-b{x}\d+ +api-a:{api_a} api-b:node-a +✔"),
        "the same over IPv6": (
            rf"NodePort \[2001:db8::10\]:30017/TCP +clusterBackends \(from outside\) +api-a "
            rf"api-b +api-a{x}\d+ api-b{x}\d+ +api-a:{api_a} api-b:node-a +✔"),
        "NodePort, Local policy": (
            rf"NodePort 192\.0\.2\.10:30080/TCP +localBackends \(from outside\) +ingress-a +"
            rf"ingress-a{x}20 +ingress-a:client +✔"),
        "ExternalIP, Local policy": (
            rf"ExternalIP 203\.0\.113\.7:443/TCP +localBackends \(from outside\) +shop-a +"
            rf"shop-a{x}20 +shop-a:client +✔"),
        "VIP, source range admits the client": (
            rf"LoadBalancer 203\.0\.113\.9:443/TCP +localBackends \(from outside\) +shop-a +"
            rf"shop-a{x}20 +shop-a:client +✔"),
        "NodePort, Local policy, no local endpoint": (
            rf"NodePort 192\.0\.2\.10:30090/TCP +localBackends \(empty\) +dropped \(endpoints "
            rf"elsewhere\) +timeout{x}3 +— +✔"),
        "VIP, source range refuses the client": (
            rf"LoadBalancer 203\.0\.113\.20:80/TCP +loadBalancerSourceRanges +dropped \(source "
            rf"not allowed, as kube-proxy\) +timeout{x}3 +— +✔"),
    }  # fmt: skip
    for what, pattern in rows.items():
        assert re.search(pattern, section), f"{what}: no row matching {pattern!r}:\n{section}"
    assert section.count("✔") == 8 and "✘" not in section, section


def failed_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(" ") and line.endswith("✘")]


def running(pid: int) -> bool:
    """Whether pid runs (a zombie waiting for init to reap it counts as stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().split(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return False


def assert_explained(output: str, dataplane: str) -> None:
    """The lab ends with one `explain` per policy kind, each agreeing with the kernel."""
    for kind in ("Cluster", "Local", "topology", "LocalFirst"):
        assert f"\n{kind}: $ nsenter --net=" in output, kind
    assert output.count("\nverdict:     goes to") == 4, output
    assert output.count(f"\nkernel:      {dataplane}:") == 4, output
    assert "DISAGREES" not in output, output


def test_lab_with_iptables_checks_every_service_and_removes_everything(runs) -> None:
    done = lab("--dataplane", "iptables", "--requests", "20")
    runs.append(run := run_of(done.stdout))
    assert done.returncode == 0, done.stdout + done.stderr
    assert failed_rows(done.stdout) == [] and "✘" not in done.stdout
    assert done.stdout.count("dataplane iptables (requested)") == 3
    check_rows(done.stdout)
    check_outside_rows(done.stdout, "iptables")
    assert re.search(r"LoadBalancer 203\.0\.113\.9:443/TCP +loadBalancerSourceRanges +dropped",
                     done.stdout)  # fmt: skip
    assert "-A KBP-SERVICES -d 10.96.0.10/32" in done.stdout  # the iptables-save excerpt
    assert_explained(done.stdout, "iptables")
    assert "removing the lab … done" in done.stdout
    assert_nothing_left(run)


def test_lab_with_nftables_checks_every_service_and_removes_everything(runs) -> None:
    done = lab("--dataplane", "nftables", "--requests", "20")
    runs.append(run := run_of(done.stdout))
    assert done.returncode == 0, done.stdout + done.stderr
    assert failed_rows(done.stdout) == [] and "✘" not in done.stdout
    assert done.stdout.count("dataplane nftables (requested)") == 3
    check_rows(done.stdout)
    check_outside_rows(done.stdout, "nftables")
    assert re.search(r"LoadBalancer 203\.0\.113\.9:443/TCP +loadBalancerSourceRanges +dropped",
                     done.stdout)  # fmt: skip
    assert "kube-bpf-proxy inspect nftables" in done.stdout
    assert re.search(r"10\.96\.0\.10:80/TCP +- +pick-h-\d+: 10\.", done.stdout)  # inspect
    assert re.search(r"@pick-h-\d+ goto pick-h-\d+", done.stdout)  # the pick chains in use
    assert_explained(done.stdout, "nftables")
    assert "removing the lab … done" in done.stdout
    assert_nothing_left(run)


def test_lab_with_the_default_dataplane_checks_every_service(runs) -> None:
    done = lab("--requests", "20")
    runs.append(run := run_of(done.stdout))
    assert "removing the lab … done" in done.stdout
    assert_nothing_left(run)
    check_rows(done.stdout)
    dataplane = "ebpf" if "dataplane ebpf" in done.stdout else "iptables"
    check_outside_rows(done.stdout, dataplane)
    if dataplane == "ebpf":
        # The agent attached XDP to eth0 by itself; the outside client's requests moved
        # its counters: forwarded to node-b, dropped by source range and by policy.
        xdp = done.stdout[done.stdout.index("kube-bpf-proxy inspect xdp") :]
        assert re.search(r"^eth0 +\d+ +(native|generic)$", xdp, re.MULTILINE), xdp
        for verdict in ("(tx|redirect)", "drop-range", "drop-no-backend"):
            assert re.search(rf"^{verdict} +[1-9]", xdp, re.MULTILINE), (verdict, xdp)
        assert "kube-bpf-proxy inspect --bpffs" in done.stdout
        assert "10.96.0.10:80/TCP         ClusterIP" in done.stdout  # the inspect table
        assert "bpftool map dump pinned" in done.stdout and '"service_id"' in done.stdout
        assert_explained(done.stdout, "ebpf")
    # every row, NodePorts to a backend on the client's own node included
    assert failed_rows(done.stdout) == [], done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


def test_lab_keep_leaves_the_lab_up_and_lab_down_removes_it(runs) -> None:
    kept = lab("--dataplane", "iptables", "--requests", "2", "--keep")
    runs.append(run := run_of(kept.stdout))
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "The lab stays up (--keep)" in kept.stdout
    assert "lab down" in kept.stdout
    namespaces = namespaces_of(run)
    assert f"{run.prefix}node-a" in namespaces and f"{run.prefix}client-a" in namespaces
    assert f"{run.prefix}outside" in namespaces
    processes = {pid for ns in namespaces for pid in pids_in(ns)}
    assert len(agents_of(run)) == 3 and len(processes) > 3
    # Still working without the lab process: client-a reaches web through the agents' rules.
    answer = subprocess.run(
        ["ip", "netns", "exec", f"{run.prefix}client-a", "curl", "-s", "-m", "2",
         "http://10.96.0.10/"], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert answer.stdout.strip() in ("default/web-a", "default/web-b"), answer
    # ... and the outside client reaches edge/ingress's NodePort on node-a, whose pod sees
    # the client's own address (externalTrafficPolicy Local).
    answer = subprocess.run(
        ["ip", "netns", "exec", f"{run.prefix}outside", "curl", "-si", "-m", "2",
         "http://192.0.2.10:30080/"], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "X-Peer: 192.0.2.100" in answer.stdout, answer
    assert answer.stdout.rstrip().endswith("edge/ingress-a"), answer

    down = lab("down", run.id)  # only this run: another session's kept lab stays
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"lab {run.id}: stopped" in down.stdout
    assert_nothing_left(run)
    assert not [pid for pid in processes if running(pid)]
