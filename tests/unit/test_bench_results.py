"""bench/RESULTS.md has a row for every PB id that bench/README.md's targets name, each row
with a figure, a date, a commit and pass or miss, and names no PB id README.md does not."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"
PB_ID = re.compile(r"\bPB-(\d+)\b")
COLUMNS = ["id", "what", "target", "current figure", "date", "commit", "result", "run"]
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
COMMIT = re.compile(r"^[0-9a-f]{7,40}\b")
RESULT = re.compile(r"^(pass|miss)\b")


def readme_ids() -> set[int]:
    return {int(n) for n in PB_ID.findall((BENCH / "README.md").read_text(encoding="utf-8"))}


def result_rows() -> list[list[str]]:
    rows = []
    for line in (BENCH / "RESULTS.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| PB-"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def header() -> list[str]:
    for line in (BENCH / "RESULTS.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| id "):
            return [cell.strip() for cell in line.strip().strip("|").split("|")]
    return []


def test_every_pb_id_of_the_readme_has_a_row() -> None:
    ids = readme_ids()
    assert ids, "bench/README.md names no PB id"
    rows = {int(PB_ID.fullmatch(row[0]).group(1)) for row in result_rows()}
    assert sorted(ids - rows) == [], "PB ids of bench/README.md without a row in RESULTS.md"
    assert sorted(rows - ids) == [], "rows of RESULTS.md for PB ids README.md does not name"


def test_every_row_has_a_figure_a_date_a_commit_and_a_result() -> None:
    assert header() == COLUMNS
    for row in result_rows():
        assert len(row) == len(COLUMNS), row[0]
        cells = dict(zip(COLUMNS, row, strict=True))
        assert all(cells.values()), f"{row[0]}: an empty cell"
        assert DATE.match(cells["date"]), f"{row[0]}: date {cells['date']!r}"
        assert COMMIT.match(cells["commit"]), f"{row[0]}: commit {cells['commit']!r}"
        assert RESULT.match(cells["result"]), f"{row[0]}: result {cells['result']!r}"


def test_every_note_a_row_names_exists() -> None:
    for row in result_rows():
        for note in re.findall(r"notes/[\w-]+\.md", row[-1]):
            assert (BENCH / note).is_file(), f"{row[0]}: {note}"
