"""`kube-bpf-proxy compile` as a user runs it: flags, env vars, outputs and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.cli import COMPILE_SETTINGS, RUN_SETTINGS, build_parser, main
from agent.config import ENV_PREFIX, SETTINGS_FIELDS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = str(ROOT / "examples")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_kbp_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SETTINGS_FIELDS:
        monkeypatch.delenv(ENV_PREFIX + name.upper(), raising=False)


def test_compile_prints_the_node_state_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "compile", "--manifests", EXAMPLES, "--node", "node-a", "-o", "json"
    )
    document = json.loads(out)
    assert (code, err) == (0, "")
    assert (document["kind"], document["node"]["name"]) == ("NodeState", "node-a")
    assert document["revision"].startswith("sha256:")


def test_output_is_byte_identical_across_runs(capsys: pytest.CaptureFixture[str]) -> None:
    first = run(capsys, "compile", "--manifests", EXAMPLES, "--node", "node-b")
    second = run(capsys, "compile", "--manifests", EXAMPLES, "--node", "node-b")
    assert first == second and first[0] == 0


def test_every_flag_has_an_env_var(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KBP_MANIFESTS", EXAMPLES)
    monkeypatch.setenv("KBP_NODE", "node-b")
    monkeypatch.setenv("KBP_NODE_IP", "192.0.2.99")
    monkeypatch.setenv("KBP_NODE_LABEL", "example.com/rack=r9")
    monkeypatch.setenv("KBP_CLUSTER_NAME", "member1")
    monkeypatch.setenv("KBP_CLUSTER_CIDR", "10.244.0.0/16")
    monkeypatch.setenv("KBP_OUTPUT", "json")
    code, out, _ = run(capsys, "compile")
    node = json.loads(out)["node"]
    assert code == 0
    assert (node["name"], node["addresses"], node["labels"]["example.com/rack"]) == (
        "node-b",
        ["192.0.2.99"],
        "r9",
    )
    assert (node["clusterName"], node["clusterCIDRs"]) == ("member1", ["10.244.0.0/16"])


def test_a_flag_beats_its_env_var(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KBP_NODE", "node-b")
    code, out, _ = run(capsys, "compile", "--manifests", EXAMPLES, "--node", "node-c")
    assert code == 0 and yaml.safe_load(out)["node"]["name"] == "node-c"


@pytest.mark.parametrize(
    ("command", "names"), [("compile", COMPILE_SETTINGS), ("run", RUN_SETTINGS)]
)
def test_help_documents_every_flag_with_its_env_var(command: str, names: list[str]) -> None:
    subparsers = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    help_text = " ".join(subparsers.choices[command].format_help().split())
    for name in names:
        assert SETTINGS_FIELDS[name].metadata["flag"] in help_text
        assert f"env {ENV_PREFIX}{name.upper()}" in help_text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node-ip", "300.1.1.1"], "--node-ip: '300.1.1.1' is not a valid IP address"),
        (["--node-label", "rack"], "--node-label: 'rack' is not KEY=VALUE"),
        (["--nodeport-addresses", "primary,10.0.0.0/8"], "'primary' cannot be combined"),
        (["--cluster-cidr", "10.244.0.0"], "--cluster-cidr: '10.244.0.0' is not a CIDR"),
        (["-o", "table"], "invalid choice: 'table'"),
    ],
    ids=[
        "an invalid node IP is a usage error",
        "a node label without = is a usage error",
        "primary mixed with CIDRs is a usage error",
        "a cluster CIDR without a prefix is a usage error",
        "an unknown output format is a usage error",
    ],
)
def test_bad_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, "compile", "--manifests", EXAMPLES, "--node", "node-a", *argv)
    assert (code, out) == (2, "")
    assert message in err


def test_an_env_var_outside_the_choices_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KBP_OUTPUT", "table")
    code, out, err = run(capsys, "compile", "--manifests", EXAMPLES, "--node", "node-a")
    assert (code, out) == (2, "")
    assert "KBP_OUTPUT: 'table' is not one of yaml, json" in err


def test_no_manifests_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "compile", "--node", "node-a")
    assert code == 2 and "--manifests" in err


@pytest.mark.parametrize(
    "command",
    [["compile"], ["explain", "--from", "node", "--to", "10.96.0.10:53/UDP", "--no-kernel"]],
    ids=["compile", "explain"],
)
def test_a_missing_manifests_path_is_a_one_line_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    missing = str(tmp_path / "nope.yaml")
    code, out, err = run(capsys, *command, "--manifests", EXAMPLES, missing, "--node", "node-a")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"kube-bpf-proxy {command[0]}: error: --manifests {missing}: no such file or directory"
    ]


def test_an_unreadable_file_inside_a_directory_is_reported_and_strict_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    code, out, err = run(capsys, "compile", "--manifests", str(tmp_path), "--node", "node-a")
    assert code == 0 and yaml.safe_load(out)["services"] == []
    assert "dangling.yaml: cannot read: a dangling symlink" in err
    code, _, _ = run(capsys, "compile", "--manifests", str(tmp_path), "--node", "node-a",
                     "--strict")  # fmt: skip
    assert code == 1


@pytest.mark.parametrize(
    "command",
    [[sys.executable, "-m", "agent"], [str(Path(sys.executable).parent / "kube-bpf-proxy")]],
    ids=["python -m agent", "the kube-bpf-proxy console script"],
)
def test_entry_points(command: list[str]) -> None:
    result = subprocess.run(
        [*command, "compile", "--manifests", EXAMPLES, "--node", "node-a", "-o", "json"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "NodeState"


# --- kube-proxy's flags: aliases where equal, one line naming the replacement otherwise ---


def test_kube_proxys_flags_of_equal_meaning_are_aliases() -> None:
    args = build_parser().parse_args(
        ["run", "--hostname-override", "node-a", "--iptables-sync-period", "1m",
         "--iptables-min-sync-period", "1s", "--logging-format", "json"]
    )  # fmt: skip
    assert (args.node, args.sync_period, args.min_sync_period, args.log_format) == (
        "node-a", "1m", "1s", "json",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "replacement"),
    [
        (["run", "--proxy-mode", "ipvs"], "--dataplane"),
        (["run", "--proxy-mode=nftables"], "--dataplane"),
        (["run", "--cleanup"], "`kube-bpf-proxy cleanup`"),
        (["run", "--master", "https://192.0.2.1:6443"], "KUBERNETES_SERVICE_HOST"),
        (["compile", "--bind-address", "192.0.2.1"], "--node-ip"),
        (["run", "--masquerade-all"], "no equivalent here"),
    ],
    ids=["proxy-mode", "proxy-mode=", "cleanup", "master", "bind-address", "masquerade-all"],
)
def test_kube_proxys_other_flags_get_one_line_naming_the_replacement(
    capsys: pytest.CaptureFixture[str], argv: list[str], replacement: str
) -> None:
    code, out, err = run(capsys, *argv)
    flag = argv[1].split("=")[0]
    usage, error = err.splitlines()
    assert (code, out) == (2, "")
    assert usage.startswith(f"usage: kube-bpf-proxy {argv[0]} ")
    assert error.startswith(f"kube-bpf-proxy {argv[0]}: error: {flag} is kube-proxy's: ")
    assert replacement in error


def test_flags_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "compile", "--manifests", EXAMPLES, "--nodeport-address",
                       "10.0.0.0/8")  # fmt: skip
    assert code == 2
    assert err.splitlines()[-1] == (
        "kube-bpf-proxy compile: error: unrecognized arguments: --nodeport-address 10.0.0.0/8"
    )


def test_an_unknown_flag_shows_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "run", "--colour", "blue")
    assert code == 2
    assert err.splitlines() == [
        "usage: kube-bpf-proxy run [OPTIONS]  (all of them: kube-bpf-proxy run --help)",
        "kube-bpf-proxy run: error: unrecognized arguments: --colour blue",
    ]
