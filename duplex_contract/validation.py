"""msgspec validation errors, read once: which field, what kind of problem, what message.

msgspec reports ``Expected `int`, got `str` - at `$.audio.format``; every module that
turns such an error into its own (wire errors, HTTP 400s, config errors) reads it here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import msgspec

_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD_RE = re.compile(r"Object (?P<what>contains unknown|missing required) field `(?P<f>[^`]+)`")


@dataclass(frozen=True, slots=True)
class FieldProblem:
    """``message`` without its location; ``at`` where msgspec stopped (dotted, list indices
    as ``.0``); ``path`` the offending field (``at`` plus an unknown or missing field name)."""

    message: str
    at: str
    path: str
    kind: Literal["unknown", "missing", "invalid"]


def explain(exc: msgspec.ValidationError) -> FieldProblem:
    text = str(exc)
    at = ""
    if match := _PATH_RE.search(text):
        at = re.sub(r"\[(\d+)\]", r".\1", match.group("path"))
        text = text[: match.start()]
    path, kind = at, "invalid"
    if field := _FIELD_RE.match(text):
        path = f"{at}.{field.group('f')}" if at else field.group("f")
        kind = "unknown" if field.group("what") == "contains unknown" else "missing"
    return FieldProblem(text, at, path, kind)  # type: ignore[arg-type]
