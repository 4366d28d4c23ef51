"""bench/common/report.py's machine header: the CPU mitigations read from the kernel's
vulnerabilities directory, and the header naming those that change what a call costs."""

from __future__ import annotations

from pathlib import Path

from bench.common import report


def test_cpu_mitigations_keeps_only_mitigated_entries(tmp_path: Path) -> None:
    (tmp_path / "spec_rstack_overflow").write_text("Mitigation: Safe RET\n")
    (tmp_path / "spectre_v2").write_text("Mitigation: Retpolines; IBPB: conditional\n")
    (tmp_path / "meltdown").write_text("Not affected\n")
    (tmp_path / "mds").write_text("Vulnerable\n")
    assert report.cpu_mitigations(tmp_path) == {
        "spec_rstack_overflow": "Safe RET",
        "spectre_v2": "Retpolines; IBPB: conditional",
    }


def test_cpu_mitigations_without_the_directory(tmp_path: Path) -> None:
    assert report.cpu_mitigations(tmp_path / "absent") == {}


def test_the_header_names_the_cpu_and_the_call_mitigations() -> None:
    info = {
        "cpu_model": "AMD EPYC",
        "cpu_family_model": "25/1",
        "virtual_machine": True,
        "cpu_mitigations": {
            "spectre_v1": "usercopy/swapgs barriers",
            "spec_rstack_overflow": "Safe RET",
            "spectre_v2": "Retpolines; IBPB: conditional",
        },
    }
    assert report.cpu_text(info) == (
        "AMD EPYC, family/model 25/1, virtual; spectre_v2: Retpolines, "
        "spec_rstack_overflow: Safe RET"
    )
    assert report.cpu_text({"cpu_model": "Intel Xeon"}) == "Intel Xeon"
    assert report.cpu_text({}) == "unknown CPU"
