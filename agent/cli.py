"""Command line: `kube-bpf-proxy <command>` (also `python -m agent`)."""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .config import add_arguments, settings_from
from .logs import setup_logging
from .model.compile import compile
from .render import render
from .sources.manifests import load_manifests

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
COMPILE_SETTINGS = ["manifests", *NODE_SETTINGS, "output", "strict", "log_level"]
RUN_SETTINGS = [
    "manifests",
    "kubeconfig",
    *NODE_SETTINGS,
    "dataplane",
    "min_sync_period",
    "sync_period",
    "metrics_bind_address",
    "healthz_bind_address",
    "log_level",
    "log_format",
    "verbosity",
    "config",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kube-bpf-proxy",
        description="Kubernetes Service load balancing in eBPF: a kube-proxy replacement.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
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
    return parser


def cmd_compile(args: argparse.Namespace) -> int:
    settings = settings_from(args, COMPILE_SETTINGS)
    if not settings.manifests:
        raise ValueError("--manifests: at least one file or directory is required")
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
    settings = settings_from(args, RUN_SETTINGS)
    setup_logging(settings.log_level, settings.log_format, settings.verbosity)
    from .daemon import run  # imports the servers and, without --manifests, kubernetes

    return run(settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "compile":
            return cmd_compile(args)
        if args.command == "run":
            return cmd_run(args)
    except ValueError as err:  # settings validation: a usage error
        parser.exit(2, f"kube-bpf-proxy {args.command}: error: {err}\n")
    except BrokenPipeError:  # e.g. `| head`
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
