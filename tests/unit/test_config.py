"""Settings: flag > env var > --config file > default, typed, with clear errors."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from agent.cli import RUN_SETTINGS
from agent.config import (
    SETTINGS_FIELDS,
    Settings,
    add_arguments,
    format_duration,
    parse_duration,
    settings_from,
)
from agent.dataplane.ebpf.options import FLAG_MAP_SIZES, size_range

NAMES = [
    "node",
    "node_ip",
    "sync_period",
    "min_sync_period",
    "dataplane",
    "verbosity",
    "strict",
    "maglev_table_size",
    "map_size_ct",
    "pod_interfaces",
    "config",
]


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser, NAMES)
    return settings_from(parser.parse_args(argv), NAMES, environ or {})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30", 30.0), ("30s", 30.0), ("500ms", 0.5), ("1m30s", 90.0), ("2h", 7200.0), ("0", 0.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "5x", "-1s", "1m 30s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text("sync-period: 10s\nmin_sync_period: 2\nnode-ip: [192.0.2.1]\nverbosity: 3\n")
    settings = parse(
        ["--config", str(config), "--sync-period", "5s"],
        {"KBP_MIN_SYNC_PERIOD": "1s"},
    )
    assert settings.sync_period == 5.0  # flag
    assert settings.min_sync_period == 1.0  # env over file
    assert settings.node_ip == ["192.0.2.1"]  # file
    assert settings.verbosity == 3
    assert settings.dataplane == "auto"  # default


def test_the_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text("dataplane: none\nstrict: true\n")
    settings = parse([], {"KBP_CONFIG": str(config)})
    assert (settings.dataplane, settings.strict) == ("none", True)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("colour: blue\n", "unknown setting 'colour'"),
        ("- a\n- b\n", "expected a mapping"),
        ("sync-period: soon\n", "sync-period: 'soon' is not a duration"),
        ("dataplane: quantum\n", "dataplane: 'quantum' is not one of"),
        ("a: [\n", "while parsing"),
        ("maglev-table-size: 1000\n", "maglev-table-size: 1000 is not a prime"),
        ("map-size-ct: 0\n", "map-size-ct: 0 is out of range: 1024 to 16777216"),
        ("pod-interfaces: []\n", "pod-interfaces: at least one glob is required"),
    ],
    ids=[
        "an unknown key is an error",
        "a file that is not a mapping is an error",
        "a bad duration names the key",
        "a value outside the choices names the key",
        "invalid YAML is an error",
        "a Maglev table size that is not a prime names the key",
        "an empty map names the key",
        "no pod interface globs is an error",
    ],
)
def test_bad_config_files(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text(content)
    with pytest.raises(ValueError) as error:
        parse(["--config", str(config)])
    assert f"--config {config}: " in str(error.value)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--config"):
        parse(["--config", str(tmp_path / "absent.yaml")])


def test_a_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="KBP_SYNC_PERIOD"):
        parse([], {"KBP_SYNC_PERIOD": "later"})


def test_every_setting_has_a_flag_and_help() -> None:
    for name, f in SETTINGS_FIELDS.items():
        assert f.metadata["flag"].startswith("--"), name
        assert f.metadata["help"], name


# --- ranges: every setting has one, checked at start, named with where it came from ---

ALL = [*RUN_SETTINGS, "output"]  # every setting but inspect's --output
MAX = {name: size_range(name)[1] for name in FLAG_MAP_SIZES}


def parse_all(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ALL)
    return settings_from(parser.parse_args(argv), ALL, environ or {})


def error_of(argv: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ValueError) as error:
        parse_all(argv, environ)
    message = str(error.value)
    assert "\n" not in message
    return message


# (setting, flags, env, expected message): one bad value per setting at least, each
# named as a sentence. Flag values reach the check as text, like env vars.
RANGE_CASES = [
    ("manifests", ["--manifests", ""], {}, "--manifests: must not be empty"),
    ("node", ["--node", "Node_A"], {}, "--node: 'Node_A' is not a node name"),
    ("node", ["--node", "a" * 254], {}, "is not a node name"),
    ("node_ip", [], {"KBP_NODE_IP": "192.0.2.1,192.0.2.2"},
     "KBP_NODE_IP: one address per family: '192.0.2.1' and '192.0.2.2' are both IPv4"),
    ("node_ip", ["--node-ip", "192.0.2.300"], {}, "--node-ip: '192.0.2.300' is not a valid IP"),
    ("node_label", ["--node-label", "rack"], {}, "--node-label: 'rack' is not KEY=VALUE"),
    ("node_label", ["--node-label", "example.com/rack=r 1"], {}, "'r 1' is not a label value"),
    ("node_label", ["--node-label", "Example_com/rack=r1"], {}, "is not a DNS subdomain"),
    ("nodeport_addresses", ["--nodeport-addresses", "primary,10.0.0.0/8"], {},
     "--nodeport-addresses: 'primary' cannot be combined with CIDRs"),
    ("nodeport_addresses", ["--nodeport-addresses", "10.0.0.0/33"], {}, "--nodeport-addresses:"),
    ("cluster_cidr", ["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"], {},
     "--cluster-cidr: one CIDR per family"),
    ("cluster_name", ["--cluster-name", "east west"], {}, "--cluster-name: 'east west' is not a"),
    ("cluster_name", ["--cluster-name", ""], {}, "--cluster-name: must not be empty"),
    ("service_proxy_name", ["--service-proxy-name", "a/b"], {}, "--service-proxy-name: 'a/b'"),
    ("kubeconfig", ["--kubeconfig", " "], {}, "--kubeconfig: must not be empty"),
    ("dataplane", [], {"KBP_DATAPLANE": "quantum"}, "KBP_DATAPLANE: 'quantum' is not one of"),
    ("bpffs", ["--bpffs", "sys/fs/bpf"], {}, "--bpffs: 'sys/fs/bpf' is not an absolute path"),
    ("lock_dir", [], {"KBP_LOCK_DIR": "run/kube-bpf-proxy"},
     "KBP_LOCK_DIR: 'run/kube-bpf-proxy' is not an absolute path"),
    ("pod_interfaces", ["--pod-interfaces", "eth/0"], {}, "--pod-interfaces: 'eth/0' is not"),
    ("external_interfaces", [], {"KBP_EXTERNAL_INTERFACES": "eth 0"},
     "KBP_EXTERNAL_INTERFACES: 'eth 0' is not an interface name glob"),
    ("xdp", [], {"KBP_XDP": "maybe"}, "KBP_XDP: 'maybe' is not one of"),
    ("iptables_backend", [], {"KBP_IPTABLES_BACKEND": "xtables"},
     "KBP_IPTABLES_BACKEND: 'xtables' is not one of auto, nft, legacy"),
    ("socket_lb", [], {"KBP_SOCKET_LB": "pods"}, "KBP_SOCKET_LB: 'pods' is not one of"),
    ("tc_attach", [], {"KBP_TC_ATTACH": "qdisc"}, "KBP_TC_ATTACH: 'qdisc' is not one of"),
    ("cgroup_root", ["--cgroup-root", "sys/fs/cgroup"], {}, "--cgroup-root: 'sys/fs/cgroup'"),
    ("snat_port_range", ["--snat-port-range", "80-90"], {}, "--snat-port-range: '80-90' must"),
    ("snat_port_range", ["--snat-port-range", "2000-1000"], {}, "must lie within 1024-65535"),
    ("maglev_table_size", ["--maglev-table-size", "241"], {},
     "--maglev-table-size: 241 is out of range: 251 to 131071"),
    ("maglev_table_size", ["--maglev-table-size", "16383"], {}, "16383 is not a prime"),
    ("map_size_services", ["--map-size-services", str(MAX["services"] + 1)], {},
     f"--map-size-services: {MAX['services'] + 1} is out of range: 1024 to {MAX['services']}"),
    ("map_size_slots", ["--map-size-slots", "1023"], {}, "--map-size-slots: 1023 is out of range"),
    ("map_size_backends", [], {"KBP_MAP_SIZE_BACKENDS": str(2**32 + 5)},
     f"KBP_MAP_SIZE_BACKENDS: {2**32 + 5} is out of range: 1024 to {MAX['backends']}"),
    ("map_size_ct", ["--map-size-ct", "4294967301"], {}, "--map-size-ct: 4294967301 is out of"),
    ("map_size_affinity", ["--map-size-affinity", "-1"], {}, "--map-size-affinity: -1 is out of"),
    ("min_sync_period", ["--min-sync-period", "nan"], {}, "--min-sync-period: 'nan' is not a"),
    ("min_sync_period", ["--min-sync-period", "2h"], {},
     "--min-sync-period: 2h is out of range: 0s to 1h"),
    ("min_sync_period", ["--min-sync-period", "1m"], {},
     "--min-sync-period: 1m is longer than the full resync period (--sync-period (default): 30s)"),
    ("sync_period", ["--sync-period", "0"], {}, "--sync-period: 0s is out of range: 1s to 24h"),
    ("sync_period", [], {"KBP_SYNC_PERIOD": "inf"}, "KBP_SYNC_PERIOD: 'inf' is not a finite"),
    ("sync_period", ["--sync-period", "25h"], {}, "--sync-period: 25h is out of range"),
    ("conntrack_tcp_timeout_syn", ["--conntrack-tcp-timeout-syn", "0"], {},
     "--conntrack-tcp-timeout-syn: 0s is out of range: 1s to 1h"),
    ("conntrack_tcp_timeout_established", ["--conntrack-tcp-timeout-established", "30s"], {},
     "--conntrack-tcp-timeout-established: 30s is out of range: 1m to 168h"),
    ("conntrack_tcp_timeout_close_wait", [], {"KBP_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT": "nan"},
     "KBP_CONNTRACK_TCP_TIMEOUT_CLOSE_WAIT: 'nan' is not a finite"),
    ("conntrack_tcp_timeout_time_wait", ["--conntrack-tcp-timeout-time-wait", "2h"], {},
     "--conntrack-tcp-timeout-time-wait: 2h is out of range: 1s to 1h"),
    ("conntrack_udp_timeout", ["--conntrack-udp-timeout=-1s"], {},
     "--conntrack-udp-timeout:"),
    ("conntrack_udp_timeout_stream", ["--conntrack-udp-timeout-stream", "25h"], {},
     "--conntrack-udp-timeout-stream: 25h is out of range: 1s to 24h"),
    ("conntrack_sweep_interval", ["--conntrack-sweep-interval", "2h"], {},
     "--conntrack-sweep-interval: 2h is out of range: 0s to 1h"),
    ("api_idle_timeout", ["--api-idle-timeout", "500ms"], {},
     "--api-idle-timeout: 500ms is out of range: 1s to 10m"),
    ("api_request_timeout", ["--api-request-timeout", "6m"], {},
     "--api-request-timeout: 6m is out of range: 1s to 5m"),
    ("metrics_bind_address", ["--metrics-bind-address", "localhost"], {},
     "--metrics-bind-address: bind address 'localhost': expected HOST:PORT"),
    ("healthz_bind_address", ["--healthz-bind-address", "0.0.0.0:70000"], {},
     "--healthz-bind-address: bind address '0.0.0.0:70000': port must be"),
    ("state_socket", ["--state-socket", "state.sock"], {},
     "--state-socket: 'state.sock' is not an absolute path"),
    ("state_watchers", [], {"KBP_STATE_WATCHERS": "0"}, "KBP_STATE_WATCHERS: 0 is out of range"),
    ("log_format", [], {"KBP_LOG_FORMAT": "xml"}, "KBP_LOG_FORMAT: 'xml' is not one of"),
    ("service_metrics", [], {"KBP_SERVICE_METRICS": "pods"},
     "KBP_SERVICE_METRICS: 'pods' is not one of"),
    ("verbosity", ["-v", "11"], {}, "--v: 11 is out of range: 0 to 10"),
    ("verbosity", [], {"KBP_VERBOSITY": "1.9"}, "KBP_VERBOSITY: '1.9' is not an integer"),
    ("config", ["--config", ""], {}, "--config: must not be empty"),
    ("output", [], {"KBP_OUTPUT": "xml"}, "KBP_OUTPUT: 'xml' is not one of yaml, json"),
    ("strict", [], {"KBP_STRICT": "treu"}, "KBP_STRICT: 'treu' is not a boolean"),
    ("remove_kube_proxy_rules", [], {"KBP_REMOVE_KUBE_PROXY_RULES": "maybe"},
     "KBP_REMOVE_KUBE_PROXY_RULES: 'maybe' is not a boolean"),
    ("log_level", [], {"KBP_LOG_LEVEL": "loud"}, "KBP_LOG_LEVEL: 'loud' is not one of"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "argv", "environ", "message"),
    RANGE_CASES,
    ids=[f"{case[0]}: {case[3]}" for case in RANGE_CASES],
)
def test_a_value_out_of_its_range_is_one_line_naming_setting_and_source(
    name: str, argv: list[str], environ: dict[str, str], message: str
) -> None:
    assert message in error_of(argv, environ)


def test_every_setting_has_a_range_case_and_a_check() -> None:
    tested = {case[0] for case in RANGE_CASES}
    assert tested == set(ALL) | {"dataplane"}
    for name, f in SETTINGS_FIELDS.items():
        assert f.metadata.get("check") or f.metadata.get("choices") or f.type == "bool", name


@pytest.mark.parametrize(
    "argv",
    [
        ["--map-size-services", str(MAX["services"]), "--map-size-ct", "1024"],
        ["--maglev-table-size", "251"],
        ["--maglev-table-size", "131071"],
        ["--sync-period", "1s", "--min-sync-period", "1s"],
        ["--sync-period", "24h", "--min-sync-period", "1h"],
        ["--api-idle-timeout", "1s", "--api-request-timeout", "5m"],
        ["-v", "10", "--snat-port-range", "1024-65535"],
        [
            "--node-ip",
            "192.0.2.1",
            "--node-ip",
            "2001:db8::1",
            "--cluster-cidr",
            "10.244.0.0/16,fd00::/64",
            "--node-label",
            "topology.kubernetes.io/zone=z-1",
        ],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_the_ends_of_each_range_are_accepted(argv: list[str]) -> None:
    parse_all(argv)


def test_a_large_prime_maglev_table_size_is_refused_at_once() -> None:
    started = time.monotonic()
    assert "is out of range" in error_of(["--maglev-table-size", str(2**61 - 1)])
    assert time.monotonic() - started < 5  # trial division up to 2^30.5 took minutes


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("map-size-ct: true\n", "map-size-ct: true is not an integer"),
        ("map-size-ct: 1.9\n", "map-size-ct: 1.9 is not an integer"),
        ("map-size-ct: '2048'\n", "map-size-ct: '2048' is not an integer"),
        ("sync-period: .nan\n", "sync-period: nan is not a finite duration"),
        ("sync-period: true\n", "sync-period: true is not a duration"),
        ("min-sync-period: 1e400\n", "min-sync-period: '1e400' is not a"),
        ("node: 123\n", "node: 123 is not a string"),
        ("node-ip: [1]\n", "node-ip: [1] is not a list of strings"),
        ("strict: 1\n", "strict: 1 is not a boolean"),
        ("verbosity: 10000000000000000000000\n", "verbosity: 10000000000000000000000 is out"),
    ],
    ids=[
        "true is not a map size",
        "1.9 is not a map size",
        "a quoted number is not a map size",
        "nan is not a sync period",
        "true is not a sync period",
        "a huge number is not a duration",
        "a number is not a node name",
        "a number is not an IP",
        "1 is not a boolean in the file",
        "a huge verbosity is out of range",
    ],
)
def test_config_file_values_are_not_coerced(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text(content)
    assert f"--config {config}: {message}" in error_of(["--config", str(config)])


@pytest.mark.parametrize(
    ("argv", "environ", "file", "where"),
    [
        (["--sync-period", "nan"], {}, "", "--sync-period: "),
        ([], {"KBP_SYNC_PERIOD": "nan"}, "", "KBP_SYNC_PERIOD: "),
        ([], {}, "sync_period: nan\n", "sync_period: "),
    ],
    ids=["flag", "env var", "config file key"],
)
def test_the_message_names_where_the_value_came_from(
    tmp_path: Path, argv: list[str], environ: dict[str, str], file: str, where: str
) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text(file)
    message = error_of([*argv, "--config", str(config)], environ)
    assert message.startswith(f"--config {config}: {where}" if file else where)
    assert "'nan' is not a finite duration" in message


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("On", True), ("1", True), ("false", False), ("no", False), ("0", False)],
)
def test_booleans_in_the_environment(text: str, value: bool) -> None:
    assert parse_all([], {"KBP_STRICT": text}).strict is value


def test_the_default_node_name_is_the_lower_cased_hostname(monkeypatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "Worker-1")
    assert parse_all([]).node == "worker-1"


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "1e400"])
def test_durations_must_be_finite(text: str) -> None:
    with pytest.raises(ValueError, match="not a finite duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.5, "500ms"), (1.5, "1.5s"), (30, "30s"), (90, "1m30s"), (7200, "2h")],
)
def test_durations_are_written_as_flags_take_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


def test_the_iptables_backend_comes_from_flag_env_or_config_file(tmp_path: Path) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text("iptables-backend: legacy\n")
    assert parse_all([]).iptables_backend == "auto"
    assert parse_all(["--config", str(config)]).iptables_backend == "legacy"
    from_env = parse_all(["--config", str(config)], {"KBP_IPTABLES_BACKEND": "nft"})
    assert from_env.iptables_backend == "nft"
    flag = parse_all(["--iptables-backend", "auto"], {"KBP_IPTABLES_BACKEND": "nft"})
    assert flag.iptables_backend == "auto"
