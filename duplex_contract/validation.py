"""msgspec validation errors, read once: which field, what kind of problem, what message.

msgspec reports ``Expected `int`, got `str` - at `$.audio.format``; every module that
turns such an error into its own (wire errors, HTTP 400s, config errors) reads it here.
Given the type that was decoded, :func:`explain` also names the allowed values of a field
whose value is not one of them (msgspec says only ``Invalid enum value 'audio/opus'``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

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


def explain(exc: msgspec.ValidationError, decoded: Any = None) -> FieldProblem:
    """Read ``exc``; ``decoded``: the type that was being decoded, to name the allowed
    values of an enum-like field (``Invalid enum value 'x' (allowed: 'a', 'b')``)."""
    text = str(exc)
    at = ""
    if match := _PATH_RE.search(text):
        at = re.sub(r"\[(\d+)\]", r".\1", match.group("path"))
        text = text[: match.start()]
    path, kind = at, "invalid"
    if field := _FIELD_RE.match(text):
        path = f"{at}.{field.group('f')}" if at else field.group("f")
        kind = "unknown" if field.group("what") == "contains unknown" else "missing"
    if decoded is not None and text.startswith("Invalid enum value"):
        allowed = allowed_values(decoded, at)
        if allowed:
            text += f" (allowed: {', '.join(repr(v) for v in allowed)})"
    return FieldProblem(text, at, path, kind)  # type: ignore[arg-type]


def allowed_values(decoded: Any, path: str) -> tuple[object, ...]:
    """The values a ``Literal`` or ``Enum`` field at ``path`` (dotted, as in
    :class:`FieldProblem`) of type ``decoded`` accepts; () if none is found there. Every
    branch of a union that has the path counts."""
    try:
        return _allowed(decoded, path)
    except TypeError:  # not a type msgspec can inspect (or an unhashable annotation)
        return ()


@functools.cache
def _allowed(decoded: Any, path: str) -> tuple[object, ...]:
    nodes = _expand([mi.type_info(decoded)])
    for part in path.split(".") if path else ():
        found: list[mi.Type] = []
        for node in nodes:
            if isinstance(node, mi.StructType | mi.TypedDictType | mi.DataclassType):
                found += [f.type for f in node.fields if f.encode_name == part]
            elif isinstance(node, mi.ListType | mi.VarTupleType | mi.SetType) and part.isdigit():
                found.append(node.item_type)
            elif isinstance(node, mi.DictType):
                found.append(node.value_type)
        nodes = _expand(found)
    values: list[object] = []
    for node in nodes:
        if isinstance(node, mi.LiteralType):
            values += [v for v in node.values if v not in values]
        elif isinstance(node, mi.EnumType):
            values += [m.value for m in node.cls if m.value not in values]
    return tuple(values)


def _expand(nodes: list[mi.Type]) -> list[mi.Type]:
    """Unions and constrained types replaced by what they contain."""
    out: list[mi.Type] = []
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        if isinstance(node, mi.UnionType):
            stack += reversed(node.types)
        elif isinstance(node, mi.Metadata):
            stack.append(node.type)
        else:
            out.append(node)
    return out
