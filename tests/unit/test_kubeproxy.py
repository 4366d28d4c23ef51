"""kube-proxy's state as the agent reads it (agent/kubeproxy_rules.py) and netfilter's NAT flows
as the eBPF handoff reads them (agent/dataplane/ebpf/handoff.py): the parsing, without a
kernel. The kernel tier (tests/kernel/test_kube_proxy_migration.py) runs both for real."""

from __future__ import annotations

import socket

from agent.api.server import AgentStatus
from agent.dataplane.ebpf.abi import const, from_bytes, get_addr
from agent.dataplane.ebpf.handoff import KernelFlow, describe, parse_conntrack
from agent.kubeproxy_rules import Found, _chains, _jumps, kube_proxy_chain

SAVED_NAT = """\
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
:KUBE-SEP-ZP3FB6NMPNCO4VBJ - [0:0]
:KBP-SERVICES - [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j KBP-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m comment --comment "kubernetes service portals" -g KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES -d 10.96.0.80/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-SVC-NPX46M4PTMTKRN6Y -j KUBE-SEP-ZP3FB6NMPNCO4VBJ
-A KUBE-SEP-ZP3FB6NMPNCO4VBJ -s 10.244.1.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-ZP3FB6NMPNCO4VBJ -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080
""".splitlines()


def test_kube_proxys_chains_are_its_own_not_kubelets_nor_ours() -> None:
    for name in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
                 "KUBE-PROXY-CANARY", "KUBE-SVC-ABC", "KUBE-SEP-ABC", "KUBE-EXT-ABC",
                 "KUBE-FW-ABC", "KUBE-SVL-ABC", "KUBE-XLB-ABC", "KUBE-NODE-PORT"):  # fmt: skip
        assert kube_proxy_chain(name), name
    for name in ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT",
                 "KUBE-MARK-DROP", "KBP-SERVICES", "KBP-SVC-ABC", "CNI-HOSTPORT-DNAT",
                 "PREROUTING"):  # fmt: skip
        assert not kube_proxy_chain(name), name


def test_the_chains_and_the_jumps_into_them_from_other_chains() -> None:
    assert _chains(SAVED_NAT) == [
        "KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
        "KUBE-SVC-NPX46M4PTMTKRN6Y", "KUBE-SEP-ZP3FB6NMPNCO4VBJ",
    ]  # fmt: skip
    # -j and -g into kube-proxy's chains from chains not its own; never our KBP- jump,
    # never rules inside its chains (they go with the chains).
    assert _jumps(SAVED_NAT) == [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A OUTPUT -m comment --comment "kubernetes service portals" -g KUBE-SERVICES',
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
    ]


def test_found_counts_per_kind_and_says_what_in_one_line() -> None:
    assert not Found().present and Found().summary() == "nothing"
    found = Found(chains={"iptables-nft": ["IPv4 nat KUBE-SERVICES", "IPv4 nat KUBE-SVC-A"],
                          "iptables-legacy": []},
                  nft_tables=["ip kube-proxy"], ipvs_services=3, ipvs_link=True)  # fmt: skip
    assert found.present
    assert found.counts() == {"iptables-legacy": 0, "iptables-nft": 2, "nftables": 1, "ipvs": 4}
    assert found.summary() == ("iptables-nft: 2 chain(s); nftables: table(s) ip kube-proxy; "
                               "ipvs: 3 virtual server(s), link kube-ipvs0")  # fmt: skip
    assert found.to_dict() == {"iptables": {"iptables-nft": 2}, "nftables": ["ip kube-proxy"],
                               "ipvsVirtualServers": 3, "ipvsLink": True}  # fmt: skip
    assert Found(ipvs_link=True).present  # kube-ipvs0 alone is kube-proxy's too


def test_state_reports_kube_proxy_once_looked_for() -> None:
    status = AgentStatus(dataplane="ebpf", clock=lambda: 1_800_000_000.0)
    assert "kubeProxy" not in status.snapshot().to_dict()
    status.set_kube_proxy("removed", Found().to_dict())
    assert status.snapshot().to_dict()["kubeProxy"] == {
        "state": "removed",
        "checkedTime": "2027-01-15T08:00:00.000Z",
        "found": {"iptables": {}, "nftables": [], "ipvsVirtualServers": 0, "ipvsLink": False},
    }


CONNTRACK_L = """\
tcp      6 431996 ESTABLISHED src=10.244.1.1 dst=10.96.0.80 sport=38430 dport=80 \
src=10.244.1.2 dst=10.244.1.1 sport=8080 dport=38430 [ASSURED] mark=0 use=1
tcp      6 117 TIME_WAIT src=10.244.1.1 dst=10.244.1.3 sport=40000 dport=8080 \
src=10.244.1.3 dst=10.244.1.1 sport=8080 dport=40000 [ASSURED] mark=0 use=1
tcp      6 110 TIME_WAIT src=10.244.1.1 dst=10.96.0.80 sport=38000 dport=80 \
src=10.244.1.4 dst=10.244.1.1 sport=8080 dport=38000 [ASSURED] mark=0 use=1
udp      17 27 src=10.244.1.1 dst=10.96.0.10 sport=5353 dport=53 [UNREPLIED] \
src=10.244.1.5 dst=10.244.1.1 sport=53 dport=5353 mark=0 use=1
tcp      6 300 ESTABLISHED src=fd00:244:1::1 dst=fd00:96::80 sport=41000 dport=80 \
src=fd00:244:1::2 dst=fd00:244:1::1 sport=8080 dport=41000 [ASSURED] mark=0 use=1
icmp     1 29 src=10.244.1.1 dst=10.96.0.80 type=8 code=0 id=7 src=10.244.1.2 \
dst=10.244.1.1 type=0 code=0 id=7 mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 5 flow entries have been shown.
"""


def test_netfilters_nat_flows_are_the_dnat_ones_of_conntrack_l() -> None:
    flows = parse_conntrack(CONNTRACK_L)
    assert flows == [
        KernelFlow(socket.IPPROTO_TCP, "10.244.1.1", "10.96.0.80", 38430, 80, "10.244.1.2", 8080),
        KernelFlow(socket.IPPROTO_UDP, "10.244.1.1", "10.96.0.10", 5353, 53, "10.244.1.5", 53),
        KernelFlow(
            socket.IPPROTO_TCP, "fd00:244:1::1", "fd00:96::80", 41000, 80, "fd00:244:1::2", 8080
        ),
    ]  # fmt: skip  (not the untranslated flow, the closed one, ICMP)
    assert describe(flows[:1]) == "TCP 10.244.1.1:38430 -> 10.96.0.80:80 (10.244.1.2:8080)"


def test_a_seeded_entry_is_the_forward_key_of_the_clients_packet_left_to_netfilter() -> None:
    flow = KernelFlow(socket.IPPROTO_TCP, "10.244.1.1", "10.96.0.80", 38430, 80,
                      "10.244.1.2", 8080)  # fmt: skip
    key = from_bytes("kbp_ct_key", flow.key())
    assert get_addr(key.saddr, const.KBP_FAMILY_IPV4) == "10.244.1.1"
    assert get_addr(key.daddr, const.KBP_FAMILY_IPV4) == "10.96.0.80"
    assert bytes(flow.key()[32:36]) == (38430).to_bytes(2, "big") + (80).to_bytes(2, "big")
    assert (key.proto, key.family, key.dir) == (6, const.KBP_FAMILY_IPV4, const.KBP_CT_FORWARD)
    entry = from_bytes("kbp_ct_entry", flow.entry(123))
    assert entry.backend_id == const.KBP_CT_NETFILTER == 0xFFFFFFFF
    assert entry.flags == const.KBP_CT_F_SEEN_REPLY and entry.last_seen == 123
    assert get_addr(entry.addr, const.KBP_FAMILY_IPV4) == "10.244.1.2"
