"""Settings: flag > env var > --config file > default, typed, with clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent.config import SETTINGS_FIELDS, Settings, add_arguments, parse_duration, settings_from

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
        ("dataplane: quantum\n", "--dataplane: 'quantum' is not one of"),
        ("a: [\n", "while parsing"),
        ("maglev-table-size: 1000\n", "--maglev-table-size: 1000 is not a prime"),
        ("map-size-ct: 0\n", "--map-size-ct: must be at least 1"),
        ("pod-interfaces: []\n", "--pod-interfaces: at least one glob is required"),
    ],
    ids=[
        "an unknown key is an error",
        "a file that is not a mapping is an error",
        "a bad duration names the key",
        "a value outside the choices names the flag",
        "invalid YAML is an error",
        "a Maglev table size that is not a prime names the flag",
        "an empty map names the flag",
        "no pod interface globs is an error",
    ],
)
def test_bad_config_files(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "kbp.yaml"
    config.write_text(content)
    with pytest.raises(ValueError) as error:
        parse(["--config", str(config)])
    assert message in str(error.value)


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
