"""How a dataplane declares its options: a typed, frozen dataclass beside the code that
uses them, each field that a setting sets carrying that setting's flag, help, default as
written, range or choices and the conversion from the written value to the field's type
(`option`). agent/config.py composes these declarations into the CLI flags, the KBP_*
environment variables and the --config file, and builds the dataclasses from the checked
settings (`build`); a dataplane never imports the settings module. A new option is a
field of its dataplane's options dataclass, its row in config.Settings (`_declared`) and
its name in the settings lists of the commands that take it (cli.py).

The options every kernel dataplane takes (their pod interfaces) are declared here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any

# Host-side names the common CNI plugins give the pod-facing end of a pod's veth pair:
DEFAULT_POD_INTERFACES: tuple[str, ...] = (
    "veth*",  # generic veth CNIs: bridge/ptp plugins, flannel, kindnet, Docker, Weave
    "cali*",  # Calico
    "lxc*",  # Cilium (lxc<hash>)
    "eni*",  # AWS VPC CNI
    "gke*",  # GKE's own dataplane
)


def option(
    default: Any,
    flag: str,
    help: str,
    metavar: str | None = None,
    *,
    written: Any = MISSING,
    parse: Callable[[Any], Any] | None = None,
    check: Callable[[Any], None] | None = None,
    choices: tuple[str, ...] | None = None,
    **kwargs: Any,
) -> Any:
    """A field of an options dataclass that the setting `flag` sets. `default` is the
    field's (typed) default, `written` the setting's default as a user writes it (when
    the types differ: "61000-65535" for a port range), `parse` turns a checked setting
    into the field's type, `check` raises ValueError for a bad setting (`parse` is the
    check when there is none), `choices` the setting's accepted words. Other keywords
    (`comma`, `aliases`, argparse's) go to the flag as they are."""
    if written is MISSING:
        written = list(default) if isinstance(default, tuple) else default
    metadata = {"flag": flag, "help": help, "written": written, "parse": parse,
                "check": check or parse, "choices": choices, "metavar": metavar,
                **kwargs}  # fmt: skip
    if isinstance(default, (list, dict, set)):
        raise TypeError(f"{flag}: a mutable default; use a tuple")
    return field(default=default, metadata=metadata)


def setting_name(flag: str) -> str:
    """The settings field (and KBP_* env var, config file key) of a flag."""
    return flag.removeprefix("--").replace("-", "_")


def declared(cls: type) -> dict[str, Field[Any]]:
    """The fields of an options dataclass, nested ones included, that a setting sets:
    setting name → field."""
    found: dict[str, Field[Any]] = {}
    for f in fields(cls):
        if "flag" in f.metadata:
            found[setting_name(f.metadata["flag"])] = f
        elif f.metadata.get("nested"):
            found.update(declared(type(f.default_factory())))  # type: ignore[misc]
    return found


def nested(cls: type) -> Any:
    """A field holding another options dataclass, whose own fields settings set."""
    return field(default_factory=cls, metadata={"nested": True})


def build(cls: type, settings: Mapping[str, Any], **given: Any) -> Any:
    """An options dataclass from checked settings (setting name → value as written):
    each declared field parsed from its setting, nested ones built the same way,
    `given` the fields no setting sets (or overrides)."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
        elif "flag" in f.metadata:
            value = settings[setting_name(f.metadata["flag"])]
            parse = f.metadata["parse"]
            if isinstance(f.default, tuple) and isinstance(value, list):
                value = tuple(value)
            values[f.name] = parse(value) if parse is not None else value
        elif f.metadata.get("nested"):
            values[f.name] = build(type(f.default_factory()), settings)  # type: ignore[misc]
    return cls(**values)


# --- checks shared by declarations (ValueError without the setting's name) -------------


def between(low: float, high: float, *, duration: bool = False) -> Callable[[Any], None]:
    """A check that a number lies within [low, high]."""

    def check(value: float) -> None:
        show = format_duration if duration else str
        if not low <= value <= high:
            raise ValueError(f"{show(value)} is out of range: {show(low)} to {show(high)}")

    check.low, check.high = low, high  # type: ignore[attr-defined]
    return check


def duration(low: float, high: float) -> Callable[[Any], None]:
    """A check that a duration in seconds lies within [low, high]."""
    return between(low, high, duration=True)


def format_duration(seconds: float) -> str:
    """A duration as it is written in a flag: 0s, 500ms, 30s, 1m30s, 2h."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds and seconds < 1:
        return f"{seconds * 1000:g}ms"
    whole, rest = divmod(seconds, 1)
    if rest:
        return f"{seconds:g}s"
    hours, remainder = divmod(int(whole), 3600)
    minutes, secs = divmod(remainder, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return text + (f"{secs}s" if secs or not text else "")


def interface_globs(globs: list[str] | tuple[str, ...], *, required: bool) -> None:
    if required and not globs:
        raise ValueError("at least one glob is required")
    for glob in globs:
        if not glob or "/" in glob or any(c.isspace() for c in glob):
            raise ValueError(f"{glob!r} is not an interface name glob")


def pod_interfaces_option() -> Any:
    """The --pod-interfaces field every kernel dataplane's options have."""
    return option(
        DEFAULT_POD_INTERFACES, "--pod-interfaces",
        "globs of the host-side pod interfaces the eBPF dataplane attaches to "
        f"(default: {','.join(DEFAULT_POD_INTERFACES)}, the common CNI prefixes)",
        "GLOB,...", parse=tuple, check=lambda globs: interface_globs(globs, required=True),
        comma=True,
    )  # fmt: skip
