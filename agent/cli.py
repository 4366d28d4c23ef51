"""Command line: `kube-bpf-proxy <command>` (also `python -m agent`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .config import (
    CONNTRACK_SETTINGS,
    CONNTRACK_TIMEOUTS,
    Settings,
    add_arguments,
    settings_from,
)
from .logs import setup_logging
from .model.compile import compile
from .nodelock import LockError, NodeLock
from .render import render
from .sources.manifests import load_manifests, unreadable

log = logging.getLogger("kube-bpf-proxy")

# What the compiler needs to know about this node and cluster (both commands take them).
NODE_SETTINGS = [
    "node",
    "node_ip",
    "node_label",
    "nodeport_addresses",
    "cluster_cidr",
    "cluster_name",
    "service_proxy_name",
]
COMPILE_SETTINGS = ["manifests", *NODE_SETTINGS, "output", "strict", "log_level", "config"]
RUN_SETTINGS = [
    "manifests",
    "kubeconfig",
    "api_idle_timeout",
    "api_request_timeout",
    *NODE_SETTINGS,
    "dataplane",
    "iptables_backend",
    "bpffs",
    "lock_dir",
    "pod_interfaces",
    "external_interfaces",
    "xdp",
    "cgroup_root",
    "socket_lb",
    "tc_attach",
    "snat_port_range",
    "maglev_table_size",
    "map_size_services",
    "map_size_slots",
    "map_size_backends",
    "map_size_ct",
    "map_size_affinity",
    *CONNTRACK_SETTINGS,
    "remove_kube_proxy_rules",
    "min_sync_period",
    "sync_period",
    "metrics_bind_address",
    "service_metrics",
    "healthz_bind_address",
    "state_socket",
    "state_watchers",
    "log_level",
    "log_format",
    "verbosity",
    "strict",
    "config",
]

# inspect conntrack shows each flow's time left by the same timeouts as the agent's.
INSPECT_SETTINGS = ["bpffs", "inspect_output", *CONNTRACK_TIMEOUTS, "log_level",
                    "config"]  # fmt: skip
LAB_SETTINGS = ["manifests", "dataplane", "config"]
# explain: the agent's /state (--metrics-bind-address), or --manifests compiled for --node.
EXPLAIN_SETTINGS = ["manifests", *NODE_SETTINGS, "metrics_bind_address", "bpffs",
                    "inspect_output", "log_level", "config"]  # fmt: skip
CLEANUP_SETTINGS = ["bpffs", "lock_dir", "log_level", "config"]
FOLLOW_SETTINGS = ["metrics_bind_address", "state_socket", "log_level", "config"]
INSPECT_VIEWS = ("frontends", "backends", "conntrack", "affinity", "counters", "xdp", "tc",
                 "nftables")  # fmt: skip


# kube-proxy's flags whose meaning differs from every flag here: each is answered with
# one line naming what replaced it (its aliases of equal meaning are on the settings, in
# agent/config.py). docs/kube-proxy.md has the whole table.
_NO_EQUIVALENT = "no equivalent here (docs/kube-proxy.md lists what it did)"
KUBE_PROXY_FLAGS = {
    "--proxy-mode": "there are no proxy modes: --dataplane auto|ebpf|nftables|iptables|none "
    "picks what programs the node (auto: eBPF, else nftables, else iptables)",
    "--cleanup": "use `kube-bpf-proxy cleanup` (removes what this agent installed); "
    "kube-proxy's own rules: `kube-bpf-proxy cleanup --kube-proxy`, or run "
    "--remove-kube-proxy-rules (docs/migration.md)",
    "--master": "set the API server's address with KUBERNETES_SERVICE_HOST and "
    "KUBERNETES_SERVICE_PORT, or a --kubeconfig whose server is it",
    "--bind-address": "use --node-ip IP (kube-proxy's --bind-address only overrides the node's "
    "primary IP; it binds nothing)",
    "--pod-interface-name-prefix": "use --pod-interfaces PREFIX* (globs of the pods' host-side "
    "interfaces)",
    "--detect-local-mode": "local traffic is told by --pod-interfaces and --cluster-cidr",
    "--healthz-port": "use --healthz-bind-address HOST:PORT",
    "--metrics-port": "use --metrics-bind-address HOST:PORT",
    "--ipvs-sync-period": "use --sync-period",
    "--ipvs-min-sync-period": "use --min-sync-period",
    "--write-config-to": "there is no default kube-proxy file to write: `run --help` lists the "
    "settings, docs/kube-proxy.md maps kube-proxy's",
    **{
        flag: _NO_EQUIVALENT
        for flag in (
            "--masquerade-all", "--oom-score-adj", "--conntrack-max-per-core",
            "--conntrack-min", "--conntrack-tcp-be-liberal", "--profiling", "--feature-gates",
            "--ipvs-scheduler", "--ipvs-strict-arp", "--ipvs-exclude-cidrs",
            "--ipvs-tcp-timeout", "--ipvs-tcpfin-timeout", "--ipvs-udp-timeout",
            "--pod-bridge-interface", "--init-only", "--config-sync-period",
            "--show-hidden-metrics-for-version", "--bind-address-hard-fail",
            "--iptables-masquerade-bit", "--iptables-localhost-nodeports",
            "--proxy-port-range", "--kube-api-qps", "--kube-api-burst",
            "--kube-api-content-type", "--log-flush-frequency", "--vmodule",
        )
    },
}  # fmt: skip


class CommandParser(argparse.ArgumentParser):
    """No abbreviated flags (a typo is an error, not another flag); a subcommand reports
    an unknown argument itself, with its own usage line, not the top level's."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:  # a subcommand's parser
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> None:  # type: ignore[override]
        """Two lines: a short usage naming --help, and the error."""
        usage = f"usage: {self.prog} [OPTIONS]  (all of them: {self.prog} --help)"
        if self._subparsers is not None:
            usage = f"usage: {self.prog} COMMAND [OPTIONS]  (commands: {self.prog} --help)"
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")


class _Replaced(argparse.Action):
    """A kube-proxy flag without an equal here: refused with the one line that says what
    to use instead (its value, if any, is taken and ignored)."""

    def __init__(self, option_strings: list[str], dest: str, answer: str = "") -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?",
                         help=argparse.SUPPRESS)  # fmt: skip
        self.answer = answer

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        raise argparse.ArgumentError(None, f"{option_string} is kube-proxy's: {self.answer}")


def _answer_kube_proxy_flags(parser: argparse.ArgumentParser) -> None:
    for flag, answer in KUBE_PROXY_FLAGS.items():
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, action=_Replaced, answer=answer)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kube-bpf-proxy",
        description="Kubernetes Service load balancing in eBPF: a kube-proxy replacement.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=CommandParser
    )
    compile_parser = commands.add_parser(
        "compile",
        help="print this node's NodeState compiled from manifest files",
        description="Read Services, EndpointSlices and Nodes from manifest files and print the "
        "node-local service map (NodeState) the dataplanes would program for --node. "
        "Input problems go to stderr; the document to stdout.",
    )
    add_arguments(compile_parser, COMPILE_SETTINGS)
    run_parser = commands.add_parser(
        "run",
        help="run the agent: follow the cluster and program this node",
        description="Follow Services, EndpointSlices and Nodes (from the API server, or from "
        "--manifests), compile this node's NodeState and program it with the dataplane; "
        "serve /metrics and /state on --metrics-bind-address and /healthz, /livez, /readyz "
        "on --healthz-bind-address.",
    )
    add_arguments(run_parser, RUN_SETTINGS)
    inspect_parser = commands.add_parser(
        "inspect",
        help="show the eBPF dataplane's maps: frontends, backends, conntrack, affinity, "
        "counters, xdp, tc (the tc programs: tcx links and clsact filters); or nftables: "
        "the nftables dataplane's frontends and marker",
        description="Decode the pinned maps under --bpffs into tables (or JSON): what the "
        "kernel holds right now, whether or not an agent is running.",
    )
    inspect_parser.add_argument(
        "view", nargs="?", default="frontends", choices=INSPECT_VIEWS,
        help="which map to show (default: frontends, with their backends)",
    )  # fmt: skip
    add_arguments(inspect_parser, INSPECT_SETTINGS)
    explain_parser = commands.add_parser(
        "explain",
        help="where a connection to a Service goes on this node, and why",
        description="Explain a packet's way: the NodeState's answer (from the agent's /state "
        "on --metrics-bind-address, or compiled from --manifests for --node) with the set it "
        "uses and why, each backend and the endpoints left out; then the dataplane's own "
        "answer on this node (eBPF: the pinned maps, and the attached programs' code, "
        "in a build of its own, run on the exact packet with BPF_PROG_TEST_RUN, which "
        "changes nothing; iptables and nftables: a trace through the live rules); then a "
        "one-line verdict. Disagreements between the NodeState and the kernel come first.",
    )
    explain_parser.add_argument(
        "--from", dest="source", required=True, metavar="IP|node|outside[:IP]",
        help="the client: a pod's IP, 'node' (this node's own sockets) or 'outside' "
        "(optionally with the client's address)",
    )  # fmt: skip
    explain_parser.add_argument(
        "--to", dest="target", required=True, metavar="IP:PORT[/PROTO]|NS/NAME:PORT",
        help="a frontend address (protocol TCP by default) or a Service port by name or number",
    )  # fmt: skip
    explain_parser.add_argument(
        "--sport", type=int, metavar="PORT",
        help="the client's source port (default: a fixed 40000): the flow hash depends on it",
    )  # fmt: skip
    explain_parser.add_argument(
        "--no-kernel", action="store_true",
        help="the NodeState's answer only: do not read the maps or rules of this node",
    )  # fmt: skip
    add_arguments(explain_parser, EXPLAIN_SETTINGS)
    cleanup_parser = commands.add_parser(
        "cleanup",
        help="remove what any dataplane installed: tc filters and pins, nftables tables, "
        "iptables chains",
        description="Detach kube-bpf-proxy's tc programs from every interface of this network "
        "namespace (clsact qdiscs too when nothing else uses them), remove its pins under "
        "--bpffs, delete its nftables tables (ip and ip6 kube-bpf-proxy), and remove its "
        "iptables/ip6tables jump rules and KBP- chains. Each is attempted even when another "
        "fails (exit status 1 then). Established connections through "
        "Services lose their translation. Refused (exit status 1, nothing removed) while an "
        "agent runs on --bpffs, unless --force; otherwise it holds the node's lock while it "
        "removes, so an agent that starts meanwhile waits.",
    )
    add_arguments(cleanup_parser, CLEANUP_SETTINGS)
    cleanup_parser.add_argument(
        "--force", action="store_true",
        help="remove even while an agent runs on --bpffs (it keeps running, and puts back "
        "what it serves)",
    )  # fmt: skip
    cleanup_parser.add_argument(
        "--kube-proxy", action="store_true",
        help="remove kube-proxy's state instead of ours, as `kube-proxy --cleanup` would: "
        "its KUBE- chains and the jumps to them (iptables, both backends), its nftables "
        "tables, IPVS virtual servers and kube-ipvs0; conntrack entries stay. Runs beside "
        "a running agent (it touches nothing of kube-bpf-proxy's); see docs/migration.md",
    )  # fmt: skip
    cleanup_parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="list every interface, pin, rule and chain removed (default: counts per kind)",
    )  # fmt: skip
    follow_parser = commands.add_parser(
        "follow",
        help="follow a running agent's node-local state, one line per revision",
        description="Watch the agent's /state (on --metrics-bind-address, or on its "
        "--state-socket) and print a line per NodeState revision as it comes: the "
        "revision, the agent instance, how many Services and entries, which Services "
        "changed; -o json prints each whole NodeState document instead. Reconnects when "
        "the agent restarts (the line says so). The client is agent/stateclient.py "
        '(docs/nodestate.md, "Watching the state").',
    )
    add_arguments(follow_parser, FOLLOW_SETTINGS)
    follow_parser.add_argument(
        "-o", "--output", dest="follow_output", choices=("summary", "json"), default="summary",
        help="summary (default): one line per revision; json: the whole document per line",
    )  # fmt: skip
    follow_parser.add_argument(
        "--changes", action="store_true",
        help="ask for changes only after the first document (less to read on large states)",
    )  # fmt: skip
    follow_parser.add_argument(
        "--count", type=int, default=0, metavar="N",
        help="stop after N revisions (default 0: follow until interrupted)",
    )  # fmt: skip
    lab_parser = commands.add_parser(
        "lab",
        help="build the example cluster in network namespaces and check every Service",
        description="Build nodes, pods and a client pod per node out of network namespaces "
        "from the manifests (default: examples/), run the agent on every node, make real "
        "requests to every frontend and print per Service which pods answered and whether "
        "that keeps the Service's promise; exit 0 only if every check holds. Everything is "
        "removed on exit unless --keep; `lab down` removes a kept lab. Needs root.",
    )
    lab_parser.add_argument(
        "action", nargs="?", default="up", choices=("up", "down"),
        help="up (default): build, check, remove; down: remove what a --keep run left",
    )  # fmt: skip
    lab_parser.add_argument(
        "run", nargs="?", metavar="RUN",
        help="with down: remove only this run (its id, e.g. r1a2b, as --keep printed it)",
    )  # fmt: skip
    add_arguments(lab_parser, LAB_SETTINGS)
    lab_parser.add_argument(
        "--keep", action="store_true", help="leave the lab up and print how to explore it"
    )
    lab_parser.add_argument(
        "--requests", type=int, default=20, metavar="N",
        help="requests per frontend (default: 20)",
    )  # fmt: skip
    for command_parser in (compile_parser, run_parser, explain_parser, cleanup_parser):
        _answer_kube_proxy_flags(command_parser)
    return parser


def check_manifest_paths(paths: list[str]) -> None:
    """Every --manifests path exists: a missing one would compile (or serve) an empty or
    partial state that looks like the truth. ValueError naming the first missing path."""
    for path in paths:
        if not os.path.exists(path):  # a dangling symlink too
            raise ValueError(f"--manifests {path}: {unreadable(Path(path))}")


def cmd_compile(args: argparse.Namespace) -> int:
    settings = settings_from(args, COMPILE_SETTINGS)
    if not settings.manifests:
        raise ValueError("--manifests: at least one file or directory is required")
    check_manifest_paths(settings.manifests)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(message)s")
    state, reports = load_manifests(settings.manifests)
    for report in reports:
        print(f"{'error' if report.error else 'warning'}: {report}", file=sys.stderr)
    node_state = compile(state, settings.node, settings.compile_options())
    if settings.node not in state.nodes:
        log.info("no Node %r in the manifests: using only --node-ip/--node-label", settings.node)
    sys.stdout.write(render(node_state, settings.output))
    if reports and settings.strict:
        print(f"--strict: {len(reports)} input problem(s) reported", file=sys.stderr)
        return 1
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    settings = settings_from(args, RUN_SETTINGS, warn=warnings.append)
    check_manifest_paths(settings.manifests)  # before the lock and the datapath's compile
    setup_logging(settings.log_level, settings.log_format, settings.verbosity)
    for warning in warnings:  # in the agent's log format
        log.warning("%s", warning)
    from .daemon import run  # imports the servers and, without --manifests, kubernetes

    return run(settings)


def cmd_inspect(args: argparse.Namespace) -> int:
    settings = settings_from(args, INSPECT_SETTINGS)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(message)s")
    if args.view == "nftables":
        return _inspect_nftables(settings.inspect_output)
    from .dataplane.ebpf import inspect  # cffi and libbpf only: no compiler needed

    try:
        if args.view == "conntrack":
            rows = inspect.conntrack(Path(settings.bpffs), settings.conntrack_timeouts())
        else:
            rows = inspect.VIEWS[args.view](Path(settings.bpffs))
    except inspect.InspectError as err:
        print(f"kube-bpf-proxy inspect: {err}", file=sys.stderr)
        return 1
    if settings.inspect_output == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        sys.stdout.write(inspect.render_table(args.view, rows))
    return 0


def _inspect_nftables(output: str) -> int:
    from .dataplane.base import DataplaneError
    from .dataplane.nftables import inspect as nft_inspect

    try:
        rows = nft_inspect.tables()
    except (DataplaneError, OSError) as err:
        print(f"kube-bpf-proxy inspect: nftables: {err}", file=sys.stderr)
        return 1
    if output == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        sys.stdout.write(nft_inspect.render_table(rows))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    settings = settings_from(args, EXPLAIN_SETTINGS)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(message)s")
    from .explain import command

    if args.sport is not None and not 0 < args.sport < 65536:
        raise ValueError(f"--sport {args.sport}: expected a port 1-65535")
    check_manifest_paths(settings.manifests)
    try:
        if settings.manifests:
            inputs = command.state_from_manifests(
                settings.manifests, settings.node, settings.compile_options()
            )
        else:
            inputs = command.state_from_agent(settings.metrics_bind_address)
        kernel = None if args.no_kernel else command.kernel_reader(Path(settings.bpffs))
        report = command.run_explain(inputs, args.source, args.target, args.sport, kernel)
    except command.QueryError as err:
        print(f"kube-bpf-proxy explain: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(report.json() if settings.inspect_output == "json" else report.table())
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    settings = settings_from(args, CLEANUP_SETTINGS)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(message)s")
    if args.kube_proxy:
        return _cleanup_kube_proxy(args.verbose)
    lock = NodeLock(settings.lock_dir, settings.bpffs)
    try:
        holder = lock.try_acquire()
    except LockError as err:
        if not args.force:
            print(f"kube-bpf-proxy cleanup: {err}; nothing removed (--force removes without "
                  "the lock)", file=sys.stderr)  # fmt: skip
            return 1
        print(f"kube-bpf-proxy cleanup: {err}; removing without the lock (--force)",
              file=sys.stderr)  # fmt: skip
        holder = None
    if holder is not None and not args.force:
        print(f"kube-bpf-proxy cleanup: an agent runs on {settings.bpffs}: {holder.describe()} "
              f"holds {lock.path}; nothing removed (stop the agent first, or --force)",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        ok = _cleanup(settings, args.verbose)
    finally:
        lock.release()
    if holder is not None:
        print(
            f"--force: removed while the agent (pid {holder.pid}) still runs and holds "
            f"{lock.path}; it puts back what it serves when it next checks the dataplane"
        )
    return 0 if ok else 1


def _cleanup(settings: Settings, verbose: bool) -> bool:
    """Every dataplane's parts, each even when another's failed; True when all did."""
    ok = True
    try:
        from .dataplane.ebpf.dataplane import cleanup as cleanup_ebpf

        interfaces, pins = cleanup_ebpf(Path(settings.bpffs))
    except Exception as err:
        print(f"kube-bpf-proxy cleanup: ebpf: {err}", file=sys.stderr)
        ok = False
    else:
        print(f"ebpf: detached from {len(interfaces)} interface(s); removed {len(pins)} pin(s) "
              f"under {settings.bpffs}")  # fmt: skip
        if verbose:
            print(*(f"  interface {name}" for name in interfaces), sep="\n")
            print(*(f"  pin {pin}" for pin in pins), sep="\n")
    from .dataplane.nftables.dataplane import cleanup as cleanup_nftables

    try:
        tables = cleanup_nftables()
    except Exception as err:
        print(f"kube-bpf-proxy cleanup: nftables: {err}", file=sys.stderr)
        ok = False
    else:
        print(f"nftables: removed {', '.join(tables) if tables else 'nothing'}")
    # Both iptables backends: an agent may have written to either (--iptables-backend).
    from .dataplane.iptables.dataplane import cleanup as cleanup_iptables
    from .dataplane.iptables.dataplane import installed_backends

    for backend in installed_backends():
        try:
            removed = cleanup_iptables(backend=backend)
        except Exception as err:
            print(f"kube-bpf-proxy cleanup: iptables ({backend.name}): {err}", file=sys.stderr)
            ok = False
        else:
            print(f"iptables ({backend.name}): removed {iptables_summary(removed)}")
            for item in removed if verbose else ():
                print(f"  {item}")
    return ok


def _cleanup_kube_proxy(verbose: bool) -> int:
    """`cleanup --kube-proxy`: kube-proxy's state only; 1 when some of it stayed."""
    from .kubeproxy_rules import RemoveError, detect, remove

    found = detect()
    try:
        removed = remove()
    except RemoveError as err:
        print(f"kube-bpf-proxy cleanup --kube-proxy: {err}", file=sys.stderr)
        return 1
    print(f"kube-proxy: removed {found.summary() if removed else 'nothing (none found)'}")
    for item in removed if verbose else ():
        print(f"  {item}")
    return 0


def iptables_summary(removed: list[str]) -> str:
    """What iptables cleanup removed ("IPv4 nat PREROUTING -j KBP-SERVICES", "IPv4 nat
    KBP-SVC-…"), counted per family and table: jump rules and chains."""
    counts: dict[str, list[int]] = {}
    for item in removed:
        family, table, rest = [*item.split(" ", 2), "", ""][:3]
        jump = " -j " in rest or " -g " in rest
        counts.setdefault(f"{family} {table}", [0, 0])[0 if jump else 1] += 1
    if not counts:
        return "nothing"
    parts = [f"{where}: {jumps} jump rule(s), {chains} chain(s)"
             for where, (jumps, chains) in counts.items()]  # fmt: skip
    return "; ".join(parts)


def cmd_lab(args: argparse.Namespace) -> int:
    from .lab.command import lab, lab_down  # namespaces and subprocesses: root only

    if args.action == "down":
        return lab_down(args.run)
    if args.run is not None:
        print(f"kube-bpf-proxy lab: a run id ({args.run}) goes with `lab down` only",
              file=sys.stderr)  # fmt: skip
        return 2
    settings = settings_from(args, LAB_SETTINGS)
    return lab(settings.manifests, settings.dataplane, args.keep, args.requests)


def cmd_follow(args: argparse.Namespace) -> int:
    from .stateclient import follow

    settings = settings_from(args, FOLLOW_SETTINGS)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(message)s")
    where = (
        {"socket_path": settings.state_socket}
        if settings.state_socket
        else {"url": f"http://{settings.metrics_bind_address}"}
    )
    for seen, rev in enumerate(follow(**where, changes=args.changes), start=1):  # type: ignore[arg-type]
        if args.follow_output == "json":
            print(json.dumps(rev.document, ensure_ascii=False, separators=(",", ":")))
        else:
            entries = rev.document["services"]
            services = {(e["namespace"], e["name"]) for e in entries}
            line = (f"revision {rev.revision[:19]}… instance {rev.instance[:8]} "
                    f"services {len(services)} entries {len(entries)}")  # fmt: skip
            if rev.restarted:
                line += " (the agent restarted)"
            if rev.changed:
                line += " changed " + ", ".join(f"{ns}/{name}" for ns, name in rev.changed[:5])
                line += f" (+{len(rev.changed) - 5})" if len(rev.changed) > 5 else ""
            print(line)
        sys.stdout.flush()
        if args.count and seen >= args.count:
            return 0
    return 0


COMMANDS = {
    "compile": cmd_compile,
    "follow": cmd_follow,
    "run": cmd_run,
    "inspect": cmd_inspect,
    "explain": cmd_explain,
    "cleanup": cmd_cleanup,
    "lab": cmd_lab,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
    except ValueError as err:  # settings validation: a usage error
        parser.exit(2, f"kube-bpf-proxy {args.command}: error: {err}\n")
    except BrokenPipeError:  # e.g. `| head`
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
