"""The image's kheaders branch: a node with no kernel headers on disk but CONFIG_IKHEADERS,
whose kernel offers its own headers as /sys/kernel/kheaders.tar.xz. The image's entrypoint
(scripts/image-entrypoint.sh) must then leave BCC_KERNEL_SOURCE unset, and bcc must unpack
the archive (with xz) and compile bpf/ from it.

This machine's kernel has no kheaders, so each case runs in a private mount namespace
(unshare --mount --propagation private) that makes such a node and vanishes with it:

* /lib/modules/$(uname -r) is covered by an empty tmpfs (no build/, no source/);
* /sys/kernel becomes a tmpfs holding the real entries (bound back one by one) plus
  kheaders.tar.xz, built by the test from Debian's headers in the kernel's layout
  (kernel/gen_kheaders.sh: the *.h files of include/ and arch/x86/include/, source and
  generated merged, in one tar.xz);
* /opt holds the image's agent path, /opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy: here a
  script that builds the eBPF dataplane (bcc compiles every program) and reports;
* /tmp is private, so bcc unpacks into a /tmp/kheaders-<release> of its own (a checkout
  under /tmp is bound back into it).

The machine's own mounts and files never change.
"""

from __future__ import annotations

import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import skip_or_fail
from .test_probe import in_private_mounts

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "scripts" / "image-entrypoint.sh"
IMAGE_AGENT = "/opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy"  # what the entrypoint execs
RELEASE = os.uname().release

# The stand-in for the image's agent: builds the eBPF dataplane as `run` does (bcc
# compiles bpf/), removes it again, and prints what it saw as one JSON line.
AGENT = """#!{python}
import json, os, sys
from agent.config import Settings
from agent.dataplane.select import build_ebpf

release = os.uname().release
report = {{
    "BCC_KERNEL_SOURCE": os.environ.get("BCC_KERNEL_SOURCE"),
    "modules": sorted(os.listdir(f"/lib/modules/{{release}}")),
}}
settings = Settings(dataplane="ebpf", bpffs=sys.argv[1], pod_interfaces=["vethkbp*"],
                    cgroup_root="none", map_size_services=1024, map_size_slots=4096,
                    map_size_backends=1024, map_size_ct=4096, map_size_affinity=1024)
try:
    dataplane = build_ebpf(settings.dataplane_options())
except Exception as err:
    report["error"] = str(err)[:300]
else:
    dataplane.cleanup()
    report["compiled"] = True
unpacked = f"/tmp/kheaders-{{release}}"
report["unpacked"] = os.path.isfile(f"{{unpacked}}/include/linux/kconfig.h")
print(json.dumps(report))
"""


def header_trees() -> tuple[Path, Path]:
    """Debian's headers: (common tree, arch tree with the generated headers)."""
    arch = sorted(Path("/usr/src").glob("linux-headers-*-amd64"))
    common = [Path(str(a).removesuffix("-amd64") + "-common") for a in arch]
    found = [(c, a) for c, a in zip(common, arch, strict=True) if c.is_dir()]
    if not found:
        skip_or_fail("no Debian kernel headers in /usr/src (install linux-headers-amd64)")
    return found[-1]


@pytest.fixture(scope="module")
def kheaders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kheaders.tar.xz as the kernel builds it: the .h files of include/ and
    arch/x86/include/, source and generated trees merged (generated last)."""
    common, arch = header_trees()
    archive = tmp_path_factory.mktemp("kheaders") / "kheaders.tar.xz"
    with tarfile.open(archive, "w:xz", preset=1) as tar:
        for tree in (common, arch):
            for part in ("include", "arch/x86/include"):
                top = tree / part
                for directory, _, files in os.walk(top, followlinks=True):
                    for name in sorted(f for f in files if f.endswith(".h")):
                        path = Path(directory) / name
                        tar.add(path, arcname=f"./{path.relative_to(tree)}", recursive=False)
    return archive


def node_without_headers(tmp_path: Path, archive: Path | None) -> str:
    """The shell that turns the private mount namespace into a node without headers on
    disk, with the kernel's archive when `archive` is given."""
    stage = tmp_path / "sys-kernel"
    agent = tmp_path / "agent"
    agent.write_text(AGENT.format(python=sys.executable), encoding="utf-8")
    agent.chmod(0o755)
    steps = [
        f"mkdir {stage}",
        f"mount --rbind /sys/kernel {stage}",
        "mount -t tmpfs kbp-test /sys/kernel",
        f'for entry in {stage}/*; do name="${{entry##*/}}"; '
        'if [ -d "$entry" ]; then mkdir "/sys/kernel/$name"; else : > "/sys/kernel/$name"; fi; '
        'mount --rbind "$entry" "/sys/kernel/$name"; done',
    ]
    if archive is not None:
        steps.append(f": > /sys/kernel/kheaders.tar.xz && "
                     f"mount --bind {archive} /sys/kernel/kheaders.tar.xz")  # fmt: skip
    steps += [
        f"mount -t tmpfs kbp-test /lib/modules/{RELEASE}",
        "mount -t tmpfs kbp-test /opt",
        f"mkdir -p {Path(IMAGE_AGENT).parent} && cp {agent} {IMAGE_AGENT}",
    ]
    # Last: the steps above read files under /tmp. A checkout under /tmp (a CI clone)
    # would vanish with it, so it is carried over the private /tmp through /mnt.
    if ROOT.is_relative_to("/tmp"):
        steps += [
            "mount -t tmpfs kbp-test /mnt",
            "mkdir /mnt/checkout",
            f"mount --rbind {ROOT} /mnt/checkout",
            "mount -t tmpfs kbp-test /tmp",
            f"mkdir -p {ROOT}",
            f"mount --rbind /mnt/checkout {ROOT}",
        ]
    else:
        steps.append("mount -t tmpfs kbp-test /tmp")
    return " && ".join(steps)


def test_bcc_compiles_our_programs_from_the_kernels_kheaders_archive(
    kheaders: Path, netns: Callable[[], str], bpf_pin_dir: Path, tmp_path: Path
) -> None:
    setup = node_without_headers(tmp_path, kheaders)
    report = in_private_mounts(setup, "sh", str(ENTRYPOINT), str(bpf_pin_dir), netns=netns())
    assert report["modules"] == [], "the host's headers were not hidden"
    # The entrypoint saw the archive and left bcc to its own lookup ...
    assert report["BCC_KERNEL_SOURCE"] is None
    # ... which unpacked the archive and compiled every program from it.
    assert report.get("error") is None and report["compiled"] is True, report
    assert report["unpacked"] is True


def test_without_the_archive_nothing_else_could_have_served_the_headers(
    netns: Callable[[], str], bpf_pin_dir: Path, tmp_path: Path
) -> None:
    """The control: the same node without kheaders.tar.xz. The entrypoint points bcc at
    the image's own copy, which is not on this machine, so the compile fails: the
    headers of the case above came from the archive."""
    header_trees()
    setup = node_without_headers(tmp_path, None)
    report = in_private_mounts(setup, "sh", str(ENTRYPOINT), str(bpf_pin_dir), netns=netns())
    assert report["BCC_KERNEL_SOURCE"] == "/usr/lib/kube-bpf-proxy/kernel-headers"
    assert not Path("/usr/lib/kube-bpf-proxy").exists()
    assert "compiled" not in report and "Failed to compile BPF module" in report["error"], report
    assert report["unpacked"] is False
