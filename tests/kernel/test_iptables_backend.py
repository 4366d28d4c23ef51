"""`--iptables-backend`: which iptables (nf_tables or legacy) the iptables dataplane writes
to, against the real iptables-legacy and iptables-nft tools in throw-away network
namespaces. Rules another program left in one backend make `auto` pick it, the agent's
rules land there and nowhere else, nothing seeded picks nft without creating a legacy
table, an explicit choice is honoured, kubelet's hint chain outweighs rule counts, and
the agent's chains left in the other backend go after the first apply.

Address plan: as tests/kernel/test_iptables_restore.py (Services web 10.96.0.1, api
10.96.0.2 and fd00:96::2, dns 10.96.0.3); the seeded "CNI" rules name 10.244.0.0/16 and
the documentation prefix 198.51.100.0/24, and match no packet the tests send (none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from agent.dataplane.iptables.backend import (
    LEGACY,
    NFT,
    Backend,
    choose_backend,
    find_backend,
)
from agent.dataplane.iptables.dataplane import IptablesDataplane, cleanup
from agent.dataplane.iptables.render import FAMILIES, IPV4

from ..conftest import skip_or_fail
from .test_iptables_restore import BEFORE, POD_INTERFACES, in_ns, state

# What a CNI leaves in a node's tables: a masquerade for the pod network and a filter rule.
SEEDED = [
    ("nat", "-A POSTROUTING -s 10.244.0.0/16 ! -d 10.244.0.0/16 -j MASQUERADE"),
    ("filter", "-A INPUT -s 198.51.100.0/24 -j DROP"),
    ("filter", "-A FORWARD -s 10.244.0.0/16 -j ACCEPT"),
]


def backends() -> dict[str, Backend]:
    found = {name: find_backend(name) for name in (NFT, LEGACY)}
    missing = [f"iptables-{name}" for name, backend in found.items() if backend is None]
    if missing:
        skip_or_fail(f"{', '.join(missing)} not installed (Debian's iptables package has both)")
    return {name: backend for name, backend in found.items() if backend is not None}


@pytest.fixture
def ns(netns: Callable[[], str]) -> Iterator[str]:
    """A fresh namespace; our rules removed from both backends afterwards (the namespace
    goes too, which would take them anyway)."""
    backends()
    name = netns()
    try:
        yield name
    finally:
        cleanup(name)


def seed(ns: str, backend: Backend, rules: list[tuple[str, str]] = SEEDED) -> None:
    for table, rule in rules:
        done = in_ns(ns, backend.iptables(IPV4), "-w", "5", "-t", table, *rule.split())
        assert done.returncode == 0, done.stderr


def saved(ns: str, backend: Backend) -> str:
    """Both families' rules in `backend`, as its iptables-save prints them."""
    out = []
    for family in FAMILIES:
        done = in_ns(ns, backend.save(family))
        assert done.returncode == 0, done.stderr
        out.append(done.stdout)
    return "\n".join(out)


def tables(ns: str, backend: Backend) -> list[str]:
    """The tables `backend` holds in the namespace (both families)."""
    return [line for line in saved(ns, backend).splitlines() if line.startswith("*")]


def legacy_tables(ns: str) -> str:
    """The IPv4 legacy tables the kernel has instantiated in the namespace."""
    done = in_ns(ns, "cat", "/proc/net/ip_tables_names")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def apply(ns: str, requested: str) -> tuple[IptablesDataplane, str]:
    """A dataplane on the backend `--iptables-backend requested` picks in ns, after one
    apply of the test state; the reason for the choice."""
    backend, reason = choose_backend(requested, ns)
    dataplane = IptablesDataplane(POD_INTERFACES, netns=ns, backend=backend,
                                  backend_reason=reason)  # fmt: skip
    assert dataplane.apply(state(BEFORE)) > 0
    return dataplane, reason


def test_rules_seeded_in_legacy_make_auto_pick_legacy_and_our_rules_land_there(ns: str):
    found = backends()
    seed(ns, found[LEGACY])
    dataplane, reason = apply(ns, "auto")
    assert dataplane.backend.name == LEGACY
    assert reason == "3 rules in iptables-legacy, 0 in iptables-nft, not counting " \
                     "kube-bpf-proxy's own"  # fmt: skip
    assert dataplane.status_details()["iptablesBackend"] == {
        "name": LEGACY, "reason": reason, "save": found[LEGACY].save(IPV4),
    }  # fmt: skip
    legacy = saved(ns, found[LEGACY])
    assert "-A KBP-SERVICES -d 10.96.0.1/32" in legacy
    assert '-A PREROUTING -m comment --comment "kube-bpf-proxy service portals"' in legacy
    assert "-A KBP-SERVICES -d fd00:96::2/128" in legacy  # IPv6 too, in ip6tables-legacy
    for _, rule in SEEDED:
        assert rule in legacy  # the CNI's rules untouched
    assert tables(ns, found[NFT]) == [], "the nft tables stay empty"

    # a restart counts the same (our own rules are not counted) and adopts what is there
    restarted_backend, again = choose_backend("auto", ns)
    assert (restarted_backend.name, again) == (LEGACY, reason)
    restarted = IptablesDataplane(POD_INTERFACES, netns=ns, backend=restarted_backend)
    assert restarted.held_revision == state(BEFORE).revision
    assert restarted.apply(state(BEFORE)) == 0


def test_with_nothing_seeded_auto_picks_nft_and_creates_no_legacy_table(ns: str):
    found = backends()
    dataplane, reason = apply(ns, "auto")
    assert dataplane.backend.name == NFT
    assert reason == ("0 rules in iptables-legacy, 0 in iptables-nft (a tie: nft, the "
                      "default of current distributions)")  # fmt: skip
    assert "-A KBP-SERVICES -d 10.96.0.1/32" in saved(ns, found[NFT])
    # Deciding and cleaning the other backend only read it: no legacy table came to be.
    assert legacy_tables(ns) == ""


@pytest.mark.parametrize("requested", [NFT, LEGACY])
def test_an_explicit_backend_is_honoured_whatever_the_other_holds(ns: str, requested: str):
    found = backends()
    other = LEGACY if requested == NFT else NFT
    seed(ns, found[other])  # auto would pick the other one
    dataplane, reason = apply(ns, requested)
    assert (dataplane.backend.name, reason) == (requested, "requested")
    assert "-A KBP-SERVICES -d 10.96.0.1/32" in saved(ns, found[requested])
    assert "KBP-" not in saved(ns, found[other])
    assert all(rule in saved(ns, found[other]) for _, rule in SEEDED)


def test_kubelets_hint_chain_outweighs_the_rule_counts(ns: str):
    found = backends()
    seed(ns, found[LEGACY])  # more rules in legacy ...
    hint = in_ns(ns, found[NFT].iptables(IPV4), "-w", "5", "-t", "mangle", "-N",
                 "KUBE-IPTABLES-HINT")  # fmt: skip
    assert hint.returncode == 0, hint.stderr
    backend, reason = choose_backend("auto", ns)  # ... but kubelet writes to nft
    assert (backend.name, reason) == (
        NFT,
        "kubelet's KUBE-IPTABLES-HINT chain is in the nft tables",
    )


def test_our_chains_in_the_other_backend_go_after_the_first_apply(ns: str):
    found = backends()
    apply(ns, LEGACY)  # an earlier agent, told to use legacy
    assert "KBP-SERVICES" in saved(ns, found[LEGACY])
    seed(ns, found[NFT])  # the node is nft (our own legacy rules are not counted)
    dataplane, _ = apply(ns, "auto")
    assert dataplane.backend.name == NFT
    assert "KBP-" not in saved(ns, found[LEGACY])
    assert "-A KBP-SERVICES -d 10.96.0.1/32" in saved(ns, found[NFT])
