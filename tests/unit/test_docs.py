"""docs/operations.md checked against the code it describes: every setting (flag, env var,
default, commands), metric (type, labels), endpoint, probe, inspect view and drop reason
is there, and the settings table names nothing that does not exist, so the page cannot
silently go stale."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from agent import cli
from agent.api import AgentStatus, HealthServer, MetricsServer
from agent.config import ENV_PREFIX, Settings, default_node_name
from agent.dataplane.ebpf import service_metrics
from agent.dataplane.ebpf.abi import DROP_REASONS
from agent.dataplane.ebpf.writer import DropCollector
from agent.dataplane.probe import PROBE_NAMES
from agent.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
SETTINGS = list(fields(Settings))

# Which command takes which setting: the lists cli.py builds its parsers from.
COMMAND_SETTINGS = {
    "compile": cli.COMPILE_SETTINGS,
    "run": cli.RUN_SETTINGS,
    "inspect": cli.INSPECT_SETTINGS,
    "cleanup": cli.CLEANUP_SETTINGS,
    "lab": cli.LAB_SETTINGS,
    "explain": cli.EXPLAIN_SETTINGS,
    "follow": cli.FOLLOW_SETTINGS,
}


def text() -> str:
    return OPERATIONS.read_text(encoding="utf-8")


def table_rows() -> list[list[str]]:
    """Cells of every Markdown table row on the page (an escaped `\\|` stays in its cell)."""
    rows = []
    for line in text().splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def env_var(setting: Field[Any]) -> str:
    return ENV_PREFIX + setting.name.upper()


def documented_default(setting: Field[Any]) -> str:
    """How the settings table writes a setting's default."""
    if setting.default_factory is default_node_name:
        return "the hostname"
    has_value = setting.default is not MISSING
    value = setting.default if has_value else setting.default_factory()  # type: ignore[misc]
    if value is None or value == []:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # durations
        return f"`{value:g}s`"
    if isinstance(value, list):
        return "`" + ",".join(value) + "`"
    return f"`{value}`"


def settings_row(setting: Field[Any]) -> list[str]:
    rows = [row for row in table_rows() if len(row) == 5 and row[1] == f"`{env_var(setting)}`"]
    assert len(rows) == 1, f"{OPERATIONS.name}: {len(rows)} settings rows for {env_var(setting)}"
    return rows[0]


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_every_setting_has_a_row_with_its_flag_env_var_default_and_commands(
    setting: Field[Any],
) -> None:
    flag, _env, default, commands, meaning = settings_row(setting)
    assert f"`{setting.metadata['flag']}" in flag
    if setting.metadata.get("short"):
        assert f"`{setting.metadata['short']}" in flag
    expected = documented_default(setting)
    assert default == expected if expected == "—" else expected in default, (default, expected)
    takes_it = {command for command, names in COMMAND_SETTINGS.items() if setting.name in names}
    assert set(commands.replace(" ", "").split(",")) == takes_it
    assert meaning


def test_the_settings_table_names_only_real_settings() -> None:
    known = {env_var(s) for s in SETTINGS}
    documented = {
        row[1].strip("`") for row in table_rows()
        if len(row) == 5 and re.fullmatch(rf"`{ENV_PREFIX}[A-Z_]+`", row[1])
    }  # fmt: skip
    assert documented == known


def metric_objects() -> list[MetricWrapperBase]:
    metrics = Metrics()
    return [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]


def documented_name(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


METRICS = [
    *[(m._name, m._type, tuple(m._labelnames)) for m in metric_objects()],
    ("kbp_datapath_drops", "counter", ("reason",)),  # registered by the eBPF dataplane
    # per-Service traffic, registered by the eBPF dataplane (--service-metrics ports)
    *[
        (f.name, f.type, tuple(f._labelnames))
        for f in service_metrics.families(service_metrics.label_names("ports"))
    ],
]


@pytest.mark.parametrize("name, kind, labels", METRICS, ids=[m[0] for m in METRICS])
def test_every_metric_has_a_row_with_its_type_and_labels(name: str, kind: str, labels) -> None:
    rows = [row for row in table_rows() if row and row[0] == f"`{documented_name(name, kind)}`"]
    assert len(rows) == 1, f"no (or more than one) row for {documented_name(name, kind)}"
    row = rows[0]
    assert row[1] == kind
    for label in labels:
        assert f"`{label}`" in row[2], (label, row[2])
    if not labels:
        assert row[2] == ""


def test_the_drop_counter_documented_is_the_one_the_dataplane_registers() -> None:
    family = DropCollector.family()
    assert (family.name, family.type) == ("kbp_datapath_drops", "counter")


def test_every_drop_reason_probe_inspect_view_and_command_is_named() -> None:
    page = text()
    missing = [
        f"`{word}`"
        for word in (*DROP_REASONS.values(), *PROBE_NAMES, *cli.INSPECT_VIEWS)
        if f"`{word}`" not in page
    ]
    missing += [
        f"kube-bpf-proxy {command}"
        for command in cli.COMMANDS
        if f"`kube-bpf-proxy {command}" not in page
    ]
    assert missing == []


def served_paths(server: MetricsServer | HealthServer) -> list[str]:
    """The paths a server routes, as its 404 answer lists them."""
    try:
        urllib.request.urlopen(f"{server.url}/no-such-path", timeout=5)
    except urllib.error.HTTPError as err:
        assert err.code == 404
        return json.loads(err.read())["paths"]
    raise AssertionError("an unknown path did not answer 404")


def test_every_endpoint_of_both_servers_is_documented() -> None:
    status = AgentStatus(dataplane="none")
    with (
        MetricsServer("127.0.0.1:0", status, Metrics()) as metrics_server,
        HealthServer("127.0.0.1:0", status, 30.0) as health_server,
    ):
        paths = served_paths(metrics_server) + served_paths(health_server)
    assert sorted(paths) == ["/healthz", "/livez", "/metrics", "/proxyMode", "/readyz", "/state"]
    page = text()
    assert [p for p in paths if f"| `{p}` |" not in page] == []
