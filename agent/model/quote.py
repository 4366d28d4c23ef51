"""Input values as error messages show them: on one line, of bounded length, and never
an exception (a value nested a thousand levels deep, a megabyte string, an integer of
ten thousand digits or a lone surrogate is cut or escaped, not rendered whole)."""

from __future__ import annotations

import re
import reprlib

VALUE_CHARS = 80  # at most this much of a quoted value
NAME_CHARS = 253  # a Kubernetes name is at most 253 characters: longer ones are cut
LINE_CHARS = 1000  # at most this much of one reported line

_repr = reprlib.Repr()
_repr.maxlevel = 2
_repr.maxdict = 4
_repr.maxlist = _repr.maxtuple = _repr.maxset = 6
_repr.maxstring = VALUE_CHARS
_repr.maxother = VALUE_CHARS
_repr.maxlong = 40

_BREAK = re.compile(r"\s*[\r\n]+\s*")


def quote(value: object) -> str:
    """`repr(value)`, cut to a few levels and about VALUE_CHARS characters."""
    try:
        text = _repr.repr(value)
    except Exception:  # e.g. an int beyond the interpreter's digit limit
        text = f"<{type(value).__name__}>"
    return one_line(text, 2 * VALUE_CHARS)


def name(text: str) -> str:
    """An object's name as reports show it: itself when printable, escaped otherwise."""
    return text if text.isprintable() and len(text) <= NAME_CHARS else one_line(text, NAME_CHARS)


def one_line(text: str, limit: int = LINE_CHARS) -> str:
    """`text` on one line (line breaks become "; ", other unprintable characters are
    escaped) and cut to `limit` characters, saying how long it was."""
    total = len(text)
    if total > limit:
        text = text[: limit + 1]
    if not text.isprintable():
        text = _BREAK.sub("; ", text.strip())
        if not text.isprintable():
            text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if total > limit or len(text) > limit:
        return f"{text[:limit]}… (cut; {total} characters)"
    return text
