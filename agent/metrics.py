"""Prometheus metrics of one agent, on their own registry (so tests can run several).

Names equal kube-proxy's where the meaning is equal, so existing dashboards keep
working; everything else is prefixed `kbp_`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

# kube-proxy exports no `_created` series, and dashboards summing a family by a regex
# would count them: prometheus_client's switch is process-wide.
disable_created_metrics()

# kube-proxy's buckets for sync durations (exponential from 1 ms).
SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# client-go's rest_client_request_duration_seconds buckets.
REST_CLIENT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
# kube-proxy's network programming buckets (0.25 s .. 30 min).
PROGRAMMING_BUCKETS = (
    0.25, 0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
    25, 30, 35, 40, 45, 50, 55, 60, 75, 90, 105, 120, 135, 150, 165, 180, 195, 210,
    225, 240, 255, 270, 285, 300, 600, 900, 1200, 1500, 1800,
)  # fmt: skip


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # Exposition text rendered beside the registry at each scrape, by families too
        # many to build prometheus_client objects for (the per-Service traffic):
        # render(openmetrics) -> text of whole families.
        self.text_sections: list[Callable[[bool], str]] = []
        r = self.registry
        # One metric a row: kind(name, help, labels, ...).
        # fmt: off
        # --- kube-proxy's names -----------------------------------------------------
        # process_*: CPU, memory, open files, start time (the Go client's families).
        ProcessCollector(registry=r)
        self.sync_duration = Histogram("kubeproxy_sync_proxy_rules_duration_seconds",
            "Time a sync of the dataplane took (compile + apply).",
            buckets=SYNC_BUCKETS, registry=r)
        self.sync_full_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "Time a full sync took (the first, the periodic resyncs, the retries after a "
            "failure: the kernel compared entry by entry).", buckets=SYNC_BUCKETS, registry=r)
        self.sync_partial_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "Time a partial sync took (only what changed written).",
            buckets=SYNC_BUCKETS, registry=r)
        self.sync_last_timestamp = Gauge("kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "Unix time of the last successful sync.", registry=r)
        self.sync_last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "Unix time a sync was last asked for (a change arrived, or the agent started).",
            registry=r)
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Service changes seen and not yet taken by a sync.", registry=r)
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "EndpointSlice changes seen and not yet taken by a sync.", registry=r)
        self.healthz_requests = Counter("kubeproxy_proxy_healthz",
            "/healthz requests answered, by HTTP status code.", ["code"], registry=r)
        self.livez_requests = Counter("kubeproxy_proxy_livez",
            "/livez requests answered, by HTTP status code.", ["code"], registry=r)
        self.rest_client_requests = Counter("rest_client_requests",
            "Requests to the API server (lists, watches, the /version probe), by status "
            "code ('<error>' when none came back), method and host.",
            ["code", "method", "host"], registry=r)
        self.rest_client_duration = Histogram("rest_client_request_duration_seconds",
            "Time from sending a request to the API server to its response's headers.",
            ["verb", "host"], buckets=REST_CLIENT_BUCKETS, registry=r)
        self.network_programming = Histogram("kubeproxy_network_programming_duration_seconds",
            "From an EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time "
            "to its change being programmed.", buckets=PROGRAMMING_BUCKETS, registry=r)
        self.endpoint_changes = Counter("kubeproxy_sync_proxy_rules_endpoint_changes",
            "EndpointSlice changes seen (no-op updates excluded).", registry=r)
        self.service_changes = Counter("kubeproxy_sync_proxy_rules_service_changes",
            "Service changes seen (no-op updates excluded).", registry=r)
        self.no_local_endpoints = Gauge("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Service ports with a Local traffic policy and no endpoint on this node.",
            ["traffic_policy"], registry=r)
        # --- ours -------------------------------------------------------------------
        self.api_events = Counter("kbp_api_events",
            "Watch and list events received from the API server.",
            ["resource", "type"], registry=r)
        self.api_bytes = Counter("kbp_api_bytes_received",
            "Response bytes received from the API server (list bodies, watch streams).",
            ["resource"], registry=r)
        self.node_label_watches = Gauge("kbp_node_label_watches",
            "Metadata-only watches of other nodes' labels (one per topology key in use).",
            registry=r)
        self.api_up = Gauge("kbp_api_up",
            "1 while the watch of a resource is connected, 0 while retrying.",
            ["resource"], registry=r)
        self.revisions = Counter("kbp_nodestate_revisions",
            "NodeState revisions computed (changes only).", registry=r)
        self.kernel_writes = Counter("kbp_kernel_writes",
            "Writes made to the kernel by the dataplane.", ["dataplane"], registry=r)
        self.programmed_services = Gauge("kbp_programmed_services",
            "Service entries in the applied NodeState.", registry=r)
        self.programmed_backends = Gauge("kbp_programmed_backends",
            "Backends in the applied NodeState.", registry=r)
        self.map_fill = Gauge("kbp_map_fill_ratio",
            "Used entries / capacity of a BPF map.", ["map"], registry=r)
        self.sync_errors = Counter("kbp_sync_errors",
            "Failed syncs by reason.", ["reason"], registry=r)
        self.dataplane_repairs = Counter("kbp_dataplane_repairs",
            "Repairs of what the agent wrote and found missing or replaced (pins, tc, "
            "XDP, socket hooks, another agent's programs), by what was repaired.",
            ["what"], registry=r)
        self.next_hop_epochs = Counter("kbp_next_hop_epochs",
            "New next-hop epochs of the eBPF dataplane (every cached next hop looked up "
            "again), by cause: start, route, rule, link, neighbour (a MAC address changed "
            "or stopped resolving), lost (netlink events dropped).", ["cause"], registry=r)
        self.datapath_self_tests = Counter("kbp_datapath_self_tests",
            "Self-tests of the eBPF datapath: its programs (explain's build) run on a new "
            "connection to one programmed frontend, compared with the NodeState (pass, fail, "
            "or error when it could not run).", ["result"], registry=r)
        self.state_watchers = Gauge("kbp_state_watchers",
            "Open /state?watch=true streams (metrics address and state socket).",
            registry=r)
        self.dataplane_info = Gauge("kbp_dataplane_info",
            "1 for the dataplane in use; `reason` says why it was chosen.",
            ["dataplane", "reason"], registry=r)
        self.kube_proxy_rules = Gauge("kbp_kube_proxy_rules",
            "kube-proxy's state found in this node's network namespace at the last look: "
            "iptables chains per backend (kind iptables-legacy, iptables-nft), nftables "
            "tables (nftables), IPVS virtual servers plus the kube-ipvs0 link (ipvs).",
            ["kind"], registry=r)
        # fmt: on

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The /metrics body for an Accept header, and its content type: the registry,
        then the text sections (before OpenMetrics' closing `# EOF`)."""
        encoder, content_type = choose_encoder(accept or "")
        body = encoder(self.registry)
        if not self.text_sections:
            return body, content_type
        openmetrics = content_type.startswith("application/openmetrics-text")
        extra = "".join(section(openmetrics) for section in self.text_sections).encode()
        if openmetrics and body.endswith(b"# EOF\n"):
            return body[: -len(b"# EOF\n")] + extra + b"# EOF\n", content_type
        return body + extra, content_type
