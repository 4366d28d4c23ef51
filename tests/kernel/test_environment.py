"""The machine can run the eBPF dataplane: bcc compiles against the linked headers,
tc attaches a classifier inside a namespace, real packets reach it, and pinned maps
carry BTF so bpftool prints struct field names.

Everything happens inside network namespaces made here (never on the host's own
interfaces), with pins under a per-test bpffs directory; fixtures remove both.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel

# RFC 2544 benchmarking range: exists only inside the namespaces this test makes.
ADDR_A = "198.18.0.1"
ADDR_B = "198.18.0.2"
UDP_PORT = 9999
DATAGRAMS = 5

COUNTER_PROG = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/udp.h>

/* slot 0: every packet seen; slot 1: IPv4 UDP datagrams to KBP_PORT */
BPF_ARRAY(kbp_test_counts, u64, 2);

int kbp_test_count(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip;
    struct udphdr *udp;

    kbp_test_counts.increment(0);
    if ((void *)(eth + 1) > data_end || eth->h_proto != htons(ETH_P_IP))
        return TC_ACT_OK;
    ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > data_end || ip->ihl != 5 || ip->protocol != IPPROTO_UDP)
        return TC_ACT_OK;
    udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > data_end || udp->dest != htons(KBP_PORT))
        return TC_ACT_OK;
    kbp_test_counts.increment(1);
    return TC_ACT_OK;
}
"""

PINNED_MAP_PROG = r"""
#include <uapi/linux/pkt_cls.h>

struct kbp_test_value {
    __u64 packets;
    __u64 bytes;
    __u32 backend_id;
    __u16 port;
    __u8 flags;
    __u8 pad;
};

BPF_TABLE_PINNED("hash", __u32, struct kbp_test_value, kbp_test_pinned, 16, "PIN_PATH");

/* bcc attaches BTF to a map only when some function in the text uses it. */
int kbp_test_touch(struct __sk_buff *skb)
{
    __u32 key = 0;
    struct kbp_test_value *value = kbp_test_pinned.lookup(&key);

    if (value)
        __sync_fetch_and_add(&value->packets, 1);
    return TC_ACT_OK;
}
"""

UDP_SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(10)
print("ready", flush=True)
got = 0
try:
    while got < int(sys.argv[3]):
        s.recv(2048)
        got += 1
except TimeoutError:
    pass
print(got, flush=True)
"""

UDP_CLIENT = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(b"kbp-%d" % i, (sys.argv[1], int(sys.argv[2])))
"""


def sh(command: str, *args: str) -> str:
    """Run `command` (split on whitespace) plus args; fail the test with stderr on error."""
    argv = [*command.split(), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def in_netns(ns: str, command: str) -> str:
    """Run a command in namespace ns's network only: unlike `ip netns exec`, nsenter
    keeps this mount namespace, so /sys/fs/bpf pins stay visible to tc."""
    return sh(f"nsenter --net=/run/netns/{ns} {command}")


def pin_fd(fd: int, path: Path) -> None:
    """Pin a bcc program fd to bpffs (bcc's Python API has no pin for programs)."""
    libbpf = ctypes.CDLL("libbpf.so.1", use_errno=True)
    rc = libbpf.bpf_obj_pin(ctypes.c_int(fd), str(path).encode())
    if rc != 0:
        errno = ctypes.get_errno() or -rc
        raise OSError(errno, f"bpf_obj_pin({path}) failed")


def test_tc_classifier_counts_real_udp(netns, bpf_pin_dir: Path) -> None:
    from bcc import BPF

    # Two namespaces joined by a veth pair: client kbp-a in ns_a, server kbp-b in ns_b.
    ns_a, ns_b = netns(), netns()
    sh(f"ip -n {ns_a} link add kbp-a type veth peer name kbp-b netns {ns_b}")
    for ns, dev, addr in ((ns_a, "kbp-a", ADDR_A), (ns_b, "kbp-b", ADDR_B)):
        sh(f"ip -n {ns} addr add {addr}/30 dev {dev}")
        sh(f"ip -n {ns} link set {dev} up")
        sh(f"ip -n {ns} link set lo up")

    bpf = BPF(text=COUNTER_PROG.encode(), cflags=[f"-DKBP_PORT={UDP_PORT}"])
    try:
        fn = bpf.load_func(b"kbp_test_count", BPF.SCHED_CLS)
        prog_pin = bpf_pin_dir / "kbp_test_count"
        pin_fd(fn.fd, prog_pin)
        in_netns(ns_b, "tc qdisc add dev kbp-b clsact")
        in_netns(ns_b, f"tc filter add dev kbp-b ingress bpf da pinned {prog_pin}")
        filters = sh(f"tc -n {ns_b} filter show dev kbp-b ingress")
        assert "direct-action" in filters, filters

        udp_args = [ADDR_B, str(UDP_PORT), str(DATAGRAMS)]
        server = subprocess.Popen(
            ["ip", "netns", "exec", ns_b, sys.executable, "-c", UDP_SERVER, *udp_args],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "ready"
            sh(f"ip netns exec {ns_a} {sys.executable} -c", UDP_CLIENT, *udp_args)
            received = int(server.communicate(timeout=30)[0].strip())
        finally:
            server.kill()
            server.wait()

        counts = bpf[b"kbp_test_counts"]
        assert received == DATAGRAMS  # the classifier let every datagram through
        assert counts[1].value == DATAGRAMS
        assert counts[0].value > DATAGRAMS  # ARP as well
    finally:
        bpf.cleanup()


def test_pinned_map_has_btf_field_names(bpf_pin_dir: Path) -> None:
    from bcc import BPF

    pin = bpf_pin_dir / "kbp_test_pinned"
    text = PINNED_MAP_PROG.replace("PIN_PATH", str(pin)).encode()

    first = BPF(text=text)
    try:
        table = first[b"kbp_test_pinned"]
        table[table.Key(7)] = table.Leaf(packets=3, bytes=180, backend_id=42, port=8080, flags=1)
    finally:
        first.cleanup()
    assert pin.exists(), "BPF_TABLE_PINNED did not pin the map"

    # A second load (an agent restart) opens the same pinned map, entries intact.
    second = BPF(text=text)
    try:
        assert second[b"kbp_test_pinned"][ctypes.c_uint32(7)].backend_id == 42
    finally:
        second.cleanup()

    dump = json.loads(sh("bpftool --json map dump pinned", str(pin)))
    assert len(dump) == 1, dump
    formatted = dump[0]["formatted"]
    assert formatted["key"] == 7
    assert formatted["value"] == {
        "packets": 3,
        "bytes": 180,
        "backend_id": 42,
        "port": 8080,
        "flags": 1,
        "pad": 0,
    }
