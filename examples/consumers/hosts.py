#!/usr/bin/env python3
"""A node-local consumer of the agent's state watch: keep a hosts file of every Service's
ClusterIPs under their cluster DNS names, for a node-local DNS server that serves hosts
files (dnsmasq `--addn-hosts`, CoreDNS's `hosts` plugin with `reload`).

    sudo python3 examples/consumers/hosts.py --socket /run/kube-bpf-proxy/state.sock \\
        --out /run/kube-bpf-proxy/services.hosts

Each revision of the node's state rewrites the file (a new file renamed over the old one,
so a reader never sees half of it): one line per address,

    10.96.0.10      web.default.svc.cluster.local

It follows the agent through restarts (agent/stateclient.py reconnects). Standard
library and the repository's stateclient only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's agent/

from agent.stateclient import follow


def hosts_lines(document: dict, domain: str) -> list[str]:
    """`ADDRESS NAME` lines for the ClusterIPs of every Service in a NodeState document,
    sorted, each address once."""
    names: dict[str, str] = {}
    for entry in document["services"]:
        name = f"{entry['name']}.{entry['namespace']}.svc.{domain}"
        for frontend in entry["frontends"]:
            if frontend["type"] == "ClusterIP":
                names[frontend["ip"]] = name
    return [f"{ip:<40} {name}" for ip, name in sorted(names.items(), key=lambda i: (i[1], i[0]))]


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the agent's metrics address, e.g. http://127.0.0.1:10249")
    where.add_argument("--socket", help="the agent's --state-socket")
    parser.add_argument("--out", type=Path, required=True, help="the hosts file to keep")
    parser.add_argument("--domain", default="cluster.local", help="the cluster's DNS domain")
    parser.add_argument(
        "--count", type=int, default=0, help="stop after this many revisions (0: follow for ever)"
    )
    args = parser.parse_args()
    source = {"url": args.url} if args.url else {"socket_path": args.socket}
    for seen, rev in enumerate(follow(**source, changes=True), start=1):
        lines = hosts_lines(rev.document, args.domain)
        header = f"# kube-bpf-proxy NodeState {rev.revision} (agent {rev.instance})\n"
        write_atomically(args.out, header + "".join(line + "\n" for line in lines))
        print(f"{args.out}: {len(lines)} addresses at revision {rev.revision[:19]}", flush=True)
        if args.count and seen >= args.count:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
