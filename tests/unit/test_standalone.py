"""The repository stands alone: the design lives in docs/, and no file cites a document
outside the repository. Also: the repository's own doc references resolve (the files
exist, and Markdown anchors name a heading of their target)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}

# Documents that exist only outside the repository. Spelled in pieces so that this file
# is checked like every other one.
OUTSIDE = tuple(
    re.compile(p)
    for p in (
        "DESIGN" + r"\.md",
        "STYLE" + r"\.md",
        "BENCHMARKS" + r"\.md",
        r"\.\./" + "shared",
        "/work/" + "shared",
        "conventions" + r"\.md",
        "conventions" + r" §",
    )
)
SECTION = re.compile("\N{SECTION SIGN}" + r"\d")
ISSUE = re.compile(r"\b[Ii]ssues? \d+")  # our tracker's "issue N §M" is fine


def repo_files() -> list[Path]:
    """Tracked files plus new ones not ignored; a plain walk when git is unavailable."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
    if names:
        return [ROOT / n for n in names if (ROOT / n).is_file()]
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found += [Path(top, f) for f in files]
    return found


def texts() -> list[tuple[str, str]]:
    result = []
    for path in repo_files():
        data = path.read_bytes()
        if b"\0" in data[:4096]:
            continue  # binary
        result.append((str(path.relative_to(ROOT)), data.decode("utf-8", errors="replace")))
    return result


def test_the_file_list_covers_the_repository() -> None:
    names = {name for name, _ in texts()}
    for expected in ("README.md", "docs/semantics.md", "agent/model/compile.py", "bpf/lib/lb.h"):
        assert expected in names


def test_no_file_cites_a_document_outside_the_repository() -> None:
    found = []
    for name, text in texts():
        for number, line in enumerate(text.splitlines(), 1):
            hits = [p.pattern for p in OUTSIDE if p.search(line)]
            if SECTION.search(line) and not ISSUE.search(line):
                hits.append("a § section number of no issue")
            if hits:
                found.append(f"{name}:{number}: {', '.join(hits)}: {line.strip()}")
    assert not found, "cite the repository's docs/ instead:\n" + "\n".join(found)


# --- the repository's own references resolve -------------------------------------------

DOC_PATH = re.compile(r"(?<![\w./-])((?:docs/[\w.-]+|bench/README|examples/README)\.md)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r'<a (?:id|name)="([^"]+)"')


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_doc_paths_named_in_files_exist() -> None:
    missing = [
        f"{name}: {m.group(1)}"
        for name, text in texts()
        for m in DOC_PATH.finditer(text)
        if not (ROOT / m.group(1)).is_file()
    ]
    assert not missing, "\n".join(missing)


def test_markdown_links_resolve() -> None:
    broken = []
    for name, text in texts():
        if not name.endswith(".md"):
            continue
        here = (ROOT / name).parent
        for m in MD_LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path_part, _, anchor = target.partition("#")
            path = (here / path_part).resolve() if path_part else ROOT / name
            if not path.exists():
                broken.append(f"{name}: {target}: no such file")
            elif anchor and path.suffix == ".md":
                page = path.read_text(encoding="utf-8")
                anchors = {slug(h) for h in HEADING.findall(page)} | set(HTML_ANCHOR.findall(page))
                if anchor not in anchors:
                    broken.append(f"{name}: {target}: no such heading")
    assert not broken, "\n".join(broken)
