"""JSON Schema -> regular expression for structured output (torch-free, no dependencies).

:func:`schema_regex` turns a JSON Schema into a regular expression whose every match is a JSON
document valid under the schema, and whose matches are bounded, so that a guided request always
ends: numbers have at most :data:`MAX_INTEGER_DIGITS` integer and :data:`MAX_FRACTION_DIGITS`
fraction digits (no exponent), whitespace between tokens is one optional space. The expression
may allow fewer documents than the schema (properties are written in the schema's order, an
object written as ``{"type": "object"}`` or ``{}`` holds scalars and flat arrays only), never
more.

Supported keywords: ``type`` (one or a list), ``enum``, ``const``, ``anyOf``, ``oneOf`` (when
its branches cannot overlap), ``allOf`` with one branch, local ``$ref`` (``#/$defs/...``,
``#/definitions/...``; not recursive); integers and numbers: ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum`` (for numbers, whole-number bounds); strings:
``minLength``, ``maxLength``, ``pattern`` (alone, without lengths), ``format`` (``date``,
``time``, ``date-time``, ``uuid``); arrays: ``items``, ``minItems``, ``maxItems``,
``uniqueItems: false``; objects: ``properties``, ``required``, ``additionalProperties``.
Annotations (``title``, ``description``, ``default``, ``examples``, ...) mean nothing to
validity. Any other keyword raises :class:`UnsupportedSchemaError` naming it and where it is,
so that no part of a schema is ever ignored.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_INTEGER_DIGITS = 15  # up to 999,999,999,999,999 (< 2**53: exact as a double)
MAX_FRACTION_DIGITS = 6
WHITESPACE = r"[ ]?"

# One character of a JSON string: anything but '"', '\' and control characters (C0, DEL, C1),
# or a two-character escape. Each alternative is one character of the decoded string, so a
# counted repetition bounds the string's length exactly.
STRING_CHAR = r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
STRING = f'"{STRING_CHAR}*"'
BOOLEAN = "(true|false)"
NULL = "null"
_TIME = (r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?"
         r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
FORMATS = {
    "date": f'"{_DATE}"',
    "time": f'"{_TIME}"',
    "date-time": f'"{_DATE}T{_TIME}"',
    "uuid": '"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"',
}

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "contentMediaType", "contentEncoding"})
TYPE_KEYWORDS = {
    "null": frozenset(),
    "boolean": frozenset(),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "array": frozenset({"items", "minItems", "maxItems", "uniqueItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
TYPES = tuple(TYPE_KEYWORDS)
_MAX_INT = 10 ** MAX_INTEGER_DIGITS - 1


class UnsupportedSchemaError(ValueError):
    """A schema (or a keyword of it) that the structured-output regex cannot enforce."""


def schema_regex(schema: str | bool | dict[str, Any], whitespace: str = WHITESPACE) -> str:
    """The regular expression of (bounded) JSON documents valid under ``schema`` (as text or
    parsed). Raises :class:`UnsupportedSchemaError` (a ``ValueError``) naming the keyword it
    cannot enforce, or for a schema that is not valid JSON or allows no document."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise UnsupportedSchemaError(f"the JSON schema is not valid JSON: {e}") from e
    return _Converter(schema, whitespace).value(schema, "#")


# ------------------------------------------------------------------------------ integers
def _same_length_range(lo: str, hi: str) -> str:
    """Numbers written with exactly ``len(lo)`` digits from ``lo`` to ``hi`` (as digit
    strings, leading zeros allowed)."""
    if not lo:
        return ""
    if lo == hi:
        return lo
    n = len(lo)
    if lo == "0" * n and hi == "9" * n:
        return f"[0-9]{{{n}}}" if n > 1 else "[0-9]"
    a, b = int(lo[0]), int(hi[0])
    if a == b:
        return lo[0] + _group(_same_length_range(lo[1:], hi[1:]))
    rest = "0" * (n - 1), "9" * (n - 1)
    parts = []
    if lo[1:] == rest[0]:
        first = a
    else:
        parts.append(lo[0] + _group(_same_length_range(lo[1:], rest[1])))
        first = a + 1
    last = b if hi[1:] == rest[1] else b - 1
    if first <= last:
        digits = str(first) if first == last else f"[{first}-{last}]"
        parts.append(digits + (_same_length_range(*rest) if n > 1 else ""))
    if last < b:
        parts.append(hi[0] + _group(_same_length_range(rest[0], hi[1:])))
    return "|".join(parts)


def _group(regex: str) -> str:
    return f"({regex})" if "|" in regex else regex


def _nonnegative_range(lo: int, hi: int) -> str:
    """Integers ``lo..hi`` (0 <= lo <= hi) without leading zeros. Runs of whole digit counts
    (all 2- to 15-digit numbers, say) become one ``[1-9][0-9]{m,n}``."""
    parts: list[str] = []
    full: list[int] = []  # digit counts taken whole, consecutive

    def flush() -> None:
        if full:
            lo_d, hi_d = full[0] - 1, full[-1] - 1
            parts.append("[1-9][0-9]" + (f"{{{lo_d}}}" if lo_d == hi_d else f"{{{lo_d},{hi_d}}}"))
            full.clear()

    for digits in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(hi, 10 ** digits - 1)
        if a > b:
            continue
        if digits > 1 and a == 10 ** (digits - 1) and b == 10 ** digits - 1:
            full.append(digits)
            continue
        flush()
        parts.append(_same_length_range(str(a), str(b)))
    flush()
    return "|".join(parts)


def integer_range(lo: int | None, hi: int | None) -> str:
    """Integers from ``lo`` to ``hi`` (``None``: the digit cap) as JSON writes them."""
    if lo is None and hi is None:
        return f"(-?(0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}}))"
    lo = -_MAX_INT if lo is None else max(lo, -_MAX_INT)
    hi = _MAX_INT if hi is None else min(hi, _MAX_INT)
    if lo > hi:
        raise UnsupportedSchemaError("no integer lies within the bounds")
    parts = []
    if hi >= 0:
        parts.append(_group(_nonnegative_range(max(lo, 0), hi)))
    if lo < 0:
        parts.append("-" + _group(_nonnegative_range(max(1, -hi), -lo)))
    return f"({'|'.join(parts)})"


# --------------------------------------------------------------------------------- helpers
def _literal(value: Any) -> str:
    return re.escape(json.dumps(value, separators=(",", ":")))


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _count(schema: dict[str, Any], key: str, where: str) -> int | None:
    v = schema.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
        raise UnsupportedSchemaError(f"{key} at {where} must be a non-negative integer, got {v!r}")
    return int(v)


class _Converter:
    def __init__(self, root: Any, ws: str) -> None:
        self.root = root
        self.ws = ws
        self.refs: list[str] = []

    # ---------------------------------------------------------------------- dispatch
    def value(self, s: Any, where: str) -> str:
        if s is True:
            return self.any_value()
        if s is False:
            raise UnsupportedSchemaError(f"the schema at {where} is false: no document is valid")
        if not isinstance(s, dict):
            raise UnsupportedSchemaError(f"the schema at {where} must be an object or a boolean, "
                                         f"got {type(s).__name__}")
        keys = set(s) - ANNOTATIONS
        if "$ref" in s:
            return self.ref(s, keys, where)
        for combinator in ("anyOf", "oneOf", "allOf"):
            if combinator in s:
                return self.combine(s, combinator, keys, where)
        if "enum" in s or "const" in s:
            return self.enum(s, keys, where)
        types = s.get("type")
        if types is None:
            inferred = [t for t in TYPES if keys & TYPE_KEYWORDS[t]]
            self.check_keys(keys, set(inferred), where)
            if not inferred:
                return self.any_value()
            # keywords of several types: each type's own keywords apply to it alone
            return "(" + "|".join(self.typed(t, s, where) for t in inferred) + ")"
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
            raise UnsupportedSchemaError(f"type at {where} must be one of {', '.join(TYPES)} "
                                         f"(or a list of them), got {s['type']!r}")
        self.check_keys(keys - {"type"}, set(types), where)
        if "integer" in types and "number" in types:
            types = [t for t in types if t != "integer"]
        alts = [self.typed(t, s, where) for t in types]
        return alts[0] if len(alts) == 1 else "(" + "|".join(alts) + ")"

    def check_keys(self, keys: set[str], types: set[str], where: str) -> None:
        known = set().union(*(TYPE_KEYWORDS[t] for t in TYPE_KEYWORDS))
        for k in sorted(keys):
            if k not in known:
                raise UnsupportedSchemaError(
                    f"JSON schema keyword {k!r} (at {where}) is not supported by structured "
                    "output; see docs/api.md for the supported keywords")

    def typed(self, t: str, s: dict[str, Any], where: str) -> str:
        return getattr(self, "t_" + t)(s, where)

    def any_value(self) -> str:
        """Any JSON scalar, a flat array of scalars or an object of them (a bounded subset)."""
        ws = self.ws
        scalar = f"({STRING}|{self.number(None, None, None, None)}|{BOOLEAN}|{NULL})"
        array = rf"\[{ws}({scalar}({ws},{ws}{scalar})*)?{ws}\]"
        member = f"{STRING}{ws}:{ws}({scalar}|{array})"
        obj = rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"
        return f"({scalar}|{array}|{obj})"

    # ---------------------------------------------------------------------- keywords
    def ref(self, s: dict[str, Any], keys: set[str], where: str) -> str:
        ref = s["$ref"]
        if keys - {"$ref"}:
            raise UnsupportedSchemaError(f"keywords beside $ref (at {where}) are not supported: "
                                         f"{', '.join(sorted(keys - {'$ref'}))}")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchemaError(f"only local $ref ('#/...') is supported, got {ref!r} "
                                         f"at {where}")
        if ref in self.refs:
            raise UnsupportedSchemaError(f"recursive $ref {ref!r} (at {where}) is not supported")
        target: Any = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise UnsupportedSchemaError(f"$ref {ref!r} (at {where}) points nowhere")
        self.refs.append(ref)
        try:
            return self.value(target, ref)
        finally:
            self.refs.pop()

    def combine(self, s: dict[str, Any], kind: str, keys: set[str], where: str) -> str:
        branches = s[kind]
        if keys - {kind}:
            raise UnsupportedSchemaError(f"keywords beside {kind} (at {where}) are not "
                                         f"supported: {', '.join(sorted(keys - {kind}))}")
        if not isinstance(branches, list) or not branches:
            raise UnsupportedSchemaError(f"{kind} at {where} must be a non-empty list")
        if kind == "allOf":
            if len(branches) > 1:
                raise UnsupportedSchemaError(f"allOf with several schemas (at {where}) is not "
                                             "supported; merge them into one")
            return self.value(branches[0], f"{where}/allOf/0")
        if kind == "oneOf":  # exactly one branch may match: only when no two can overlap
            seen: set[str] = set()
            for b in branches:
                ts = self.types_of(b)
                if ts is None or ts & seen or ("number" in ts | seen and "integer" in ts | seen):
                    raise UnsupportedSchemaError(
                        f"oneOf (at {where}) is supported only when its branches have distinct "
                        "types; use anyOf")
                seen |= ts
        return "(" + "|".join(self.value(b, f"{where}/{kind}/{i}")
                              for i, b in enumerate(branches)) + ")"

    def types_of(self, s: Any) -> set[str] | None:
        """The JSON types a branch admits, when it says so plainly (else ``None``)."""
        if not isinstance(s, dict):
            return None
        if "$ref" in s and isinstance(s["$ref"], str) and s["$ref"] not in self.refs:
            try:
                target: Any = self.root
                for part in filter(None, s["$ref"][1:].split("/")):
                    target = target[part]
                return self.types_of(target)
            except (KeyError, TypeError):
                return None
        if "const" in s:
            return {_type_of(s["const"])}
        if "enum" in s and isinstance(s["enum"], list):
            return {_type_of(v) for v in s["enum"]}
        t = s.get("type")
        if isinstance(t, str):
            return {t}
        if isinstance(t, list):
            return set(t)
        return None

    def enum(self, s: dict[str, Any], keys: set[str], where: str) -> str:
        values = s["enum"] if "enum" in s else [s["const"]]
        if not isinstance(values, list) or not values:
            raise UnsupportedSchemaError(f"enum at {where} must be a non-empty list")
        if "enum" in s and "const" in s:
            values = [v for v in values if v == s["const"]]
        extra = keys - {"enum", "const", "type"}
        if extra:
            raise UnsupportedSchemaError(f"keywords beside enum/const (at {where}) are not "
                                         f"supported: {', '.join(sorted(extra))}")
        if "type" in s:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            values = [v for v in values if _type_of(v) in types
                      or (_type_of(v) == "integer" and "number" in types)]
        if not values:
            raise UnsupportedSchemaError(f"no value of the enum at {where} is valid")
        return "(" + "|".join(_literal(v) for v in values) + ")"

    # ---------------------------------------------------------------------- types
    def t_null(self, s: dict[str, Any], where: str) -> str:
        return NULL

    def t_boolean(self, s: dict[str, Any], where: str) -> str:
        return BOOLEAN

    def bounds(self, s: dict[str, Any], where: str) -> tuple[Any, Any, bool, bool]:
        lo, hi = s.get("minimum"), s.get("maximum")
        lo_x, hi_x = False, False
        for key, strict_lo in (("exclusiveMinimum", True), ("exclusiveMaximum", False)):
            v = s.get(key)
            if v is None:
                continue
            if isinstance(v, bool):  # draft 4: a flag on minimum/maximum
                if strict_lo:
                    lo_x = v and lo is not None
                else:
                    hi_x = v and hi is not None
                continue
            if strict_lo and (lo is None or v >= lo):
                lo, lo_x = v, True
            if not strict_lo and (hi is None or v <= hi):
                hi, hi_x = v, True
        for name, v in (("minimum", lo), ("maximum", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v)):
                raise UnsupportedSchemaError(f"{name} at {where} must be a number, got {v!r}")
        return lo, hi, lo_x, hi_x

    def t_integer(self, s: dict[str, Any], where: str) -> str:
        lo, hi, lo_x, hi_x = self.bounds(s, where)
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_x else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_x else math.floor(hi))
        if ilo is not None and ihi is not None and ilo > ihi:
            raise UnsupportedSchemaError(f"no integer lies within the bounds at {where}")
        return integer_range(ilo, ihi)

    def t_number(self, s: dict[str, Any], where: str) -> str:
        lo, hi, lo_x, hi_x = self.bounds(s, where)
        for name, v in (("minimum", lo), ("maximum", hi)):
            if v is not None and v != int(v):
                raise UnsupportedSchemaError(
                    f"a number bound that is not a whole number ({name} {v!r} at {where}) is "
                    "not supported")
        lo = None if lo is None else int(lo)
        hi = None if hi is None else int(hi)
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_x or hi_x))):
            raise UnsupportedSchemaError(f"no number lies within the bounds at {where}")
        return self.number(lo, hi, lo_x, hi_x)

    def number(self, lo: int | None, hi: int | None, lo_x: bool | None,
               hi_x: bool | None) -> str:
        """Numbers in [lo, hi] (open ends where ``*_x``): whole numbers (``.0`` allowed) in the
        closed integer range, and ``n + f`` / ``-(m + f)`` with a non-zero fraction ``f``
        where the whole open interval between two integers lies inside the bounds."""
        if lo is None and hi is None:  # no bound: the plain (smaller, faster) form
            return (rf"(-?(0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})"
                    rf"(\.[0-9]{{1,{MAX_FRACTION_DIGITS}}})?)")
        zeros = rf"(\.0{{1,{MAX_FRACTION_DIGITS}}})?"
        frac = rf"\.[0-9]{{0,{MAX_FRACTION_DIGITS - 1}}}[1-9]"
        ilo = None if lo is None else lo + 1 if lo_x else lo
        ihi = None if hi is None else hi - 1 if hi_x else hi
        parts = []
        if ilo is None or ihi is None or ilo <= ihi:
            parts.append(integer_range(ilo, ihi) + zeros)
        # positive non-integers n + f: need n >= lo and n + 1 <= hi
        p_lo = 0 if lo is None else max(0, lo)
        p_hi = _MAX_INT if hi is None else min(hi - 1, _MAX_INT)
        if p_lo <= p_hi:
            parts.append(_group(_nonnegative_range(p_lo, p_hi)) + frac)
        # negative non-integers -(m + f): need -(m + 1) >= lo and -m <= hi
        n_lo = 0 if hi is None else max(0, -hi)
        n_hi = _MAX_INT if lo is None else min(-lo - 1, _MAX_INT)
        if n_lo <= n_hi:
            parts.append("-" + _group(_nonnegative_range(n_lo, n_hi)) + frac)
        return "(" + "|".join(parts) + ")"

    def t_string(self, s: dict[str, Any], where: str) -> str:
        lo, hi = _count(s, "minLength", where), _count(s, "maxLength", where)
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMATS:
                raise UnsupportedSchemaError(
                    f"string format {fmt!r} (at {where}) is not supported; supported: "
                    f"{', '.join(FORMATS)}")
            if lo is not None or hi is not None or "pattern" in s:
                raise UnsupportedSchemaError(f"format with minLength/maxLength/pattern (at "
                                             f"{where}) is not supported")
            return FORMATS[fmt]
        if "pattern" in s:
            if lo is not None or hi is not None:
                raise UnsupportedSchemaError(f"pattern with minLength/maxLength (at {where}) is "
                                             "not supported; put the lengths in the pattern")
            return '"' + self.pattern(s["pattern"], where) + '"'
        lo = lo or 0
        if hi is not None and hi < lo:
            raise UnsupportedSchemaError(f"maxLength < minLength at {where}")
        if hi is None:
            count = "*" if lo == 0 else f"{{{lo},}}"
        else:
            count = f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
        return f'"{STRING_CHAR}{count}"'

    _UNSAFE_IN_PATTERN = re.compile(r'\\[WSDbBpPuxdsw0-9]|\[\^|(?<!\\)\.|"|\\\\')

    def pattern(self, pattern: Any, where: str) -> str:
        """A string ``pattern`` as the body of a JSON string: anchors dropped (a full match also
        satisfies the schema's search), and only patterns whose characters need no JSON escape
        (no ``.``, negated classes, ``"``, backslash classes)."""
        if not isinstance(pattern, str):
            raise UnsupportedSchemaError(f"pattern at {where} must be a string")
        body = pattern.removeprefix("^")
        if body.endswith("$") and not body.endswith("\\$"):
            body = body[:-1]
        if self._UNSAFE_IN_PATTERN.search(body) or any(ord(c) < 0x20 for c in body):
            raise UnsupportedSchemaError(
                f"pattern {pattern!r} (at {where}) is not supported: it may match characters a "
                "JSON string must escape (., [^...], \\w, \\s, ... or quotes); spell out the "
                "allowed characters, e.g. [A-Za-z0-9_]")
        try:
            re.compile(body)
        except re.error as e:
            raise UnsupportedSchemaError(f"pattern at {where} is not a regular expression: "
                                         f"{e}") from e
        return f"({body})"

    def t_array(self, s: dict[str, Any], where: str) -> str:
        if s.get("uniqueItems") not in (None, False):
            raise UnsupportedSchemaError(f"uniqueItems (at {where}) is not supported")
        lo, hi = _count(s, "minItems", where) or 0, _count(s, "maxItems", where)
        if hi is not None and hi < lo:
            raise UnsupportedSchemaError(f"maxItems < minItems at {where}")
        items = s.get("items", True)
        if isinstance(items, list):
            raise UnsupportedSchemaError(f"items as a list (at {where}) is not supported")
        ws = self.ws
        if hi == 0:
            return rf"\[{ws}\]"
        item = self.value(items, f"{where}/items")
        more_lo, more_hi = max(lo - 1, 0), None if hi is None else hi - 1
        if more_hi is None:
            more = "*" if more_lo == 0 else f"{{{more_lo},}}"
        else:
            more = f"{{{more_lo}}}" if more_lo == more_hi else f"{{{more_lo},{more_hi}}}"
        body = f"{item}({ws},{ws}{item}){more}"
        if lo == 0:
            body = f"({body})?"
        return rf"\[{ws}{body}{ws}\]"

    def t_object(self, s: dict[str, Any], where: str) -> str:
        ws = self.ws
        props = s.get("properties") or {}
        required = s.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            raise UnsupportedSchemaError(f"properties/required at {where} are malformed")
        extra = s.get("additionalProperties", True)
        names = list(props)
        for r in required:
            if r not in props:
                if extra is False:
                    raise UnsupportedSchemaError(
                        f"required property {r!r} is not allowed by additionalProperties: "
                        f"false (at {where})")
                names.append(r)
        if not names:
            if extra is False:
                return rf"\{{{ws}\}}"
            if extra is True:
                return self.map_of(True, where)
            return self.map_of(extra, f"{where}/additionalProperties")
        members = []
        for name in names:
            schema = props.get(name, extra if extra is not True else True)
            value = self.value(schema, f"{where}/properties/{name}")
            members.append((f"{_literal(name)}{ws}:{ws}{value}", name in required))
        # the first member written is any optional one before the first required one
        first_req = next((i for i, (_, req) in enumerate(members) if req), len(members))
        alts = []
        for i in range(min(first_req + 1, len(members))):
            rest = "".join(f"{ws},{ws}{m}" if req else f"({ws},{ws}{m})?"
                           for m, req in members[i + 1:])
            alts.append(members[i][0] + rest)
        body = "(" + "|".join(alts) + ")"
        if first_req == len(members):  # nothing required: {} too
            body += "?"
        return rf"\{{{ws}{body}{ws}\}}"

    def map_of(self, values: Any, where: str) -> str:
        """An object with any keys, each value valid under ``values``."""
        ws = self.ws
        value = self.any_value() if values is True else self.value(values, where)
        member = f"{STRING}{ws}:{ws}{value}"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"
