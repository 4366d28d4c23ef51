"""What of ours sits on an interface's tc hooks, tcx links and clsact filters alike:
`tc filter show` sees only the filters, so tests that ask "are our programs there?" ask
the attacher (what `kube-bpf-proxy inspect tc` shows)."""

from __future__ import annotations

from agent.dataplane.ebpf.netlink import TcAttacher


def our_tc_programs(netns: str, ifname: str, direction: str | None = None) -> list[str]:
    """`<direction>:<tcx|clsact>:<program>` for each program of ours (named kbp_*) on the
    interface of namespace `netns`, on one hook or both."""
    with TcAttacher(netns, mode="clsact") as attacher:  # reads only: no pins, no sweep
        return sorted(
            f"{a.direction}:{a.hook}:{a.name}"
            for a in attacher.attached()
            if a.ifname == ifname and direction in (None, a.direction)
        )
