"""Content checks on an answer: what a correct answer must and must not hold.

Users write their own as YAML/JSON (`--expect FILE`), one object per check with a `kind`:

    - kind: json_object_only                 # one JSON object, nothing before or after it
    - kind: json_values_include              # the object's leaf values, as a multiset, hold these
      values: [us-west, 4, 16]
    - kind: json_values_exclude              # ... and none of these
      values: [us-east, 2, 8]
    - kind: json_field_equals                # a field whose name contains "replica" equals 4
      field: replica
      value: 4
    - kind: contains / not_contains          # plain substring checks on the whole text
      text: us-west

Models choose their own key names ("replica_count", "replicas", "numReplicas"), so value checks
look at the object's values, not its keys; `json_field_equals` matches keys loosely (case and
punctuation ignored, substring match). Numbers match numbers or numeric strings (4 == "4" == 4.0),
strings match case-insensitively after trimming, booleans only booleans.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

JsonScalar = str | int | float | bool | None

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_EXCERPT_CHARS = 80


def excerpt(text: str, limit: int = _EXCERPT_CHARS) -> str:
    """`text` shortened to `limit` characters, as a repr so whitespace and quotes stay visible."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def canonical(value: object) -> tuple[str, object]:
    """A comparison key under which 4, 4.0 and "4" are equal, and "US-West" equals "us-west"."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    if isinstance(value, str):
        stripped = value.strip()
        if _NUMBER.fullmatch(stripped):
            return ("number", float(stripped))
        return ("string", stripped.casefold())
    if value is None:
        return ("null", None)
    return ("other", json.dumps(value, sort_keys=True))


def find_json_object(text: str) -> tuple[dict[str, object], int, int] | None:
    """The first JSON object in `text` as (object, start, end), or None when there is none."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            return value, start, end
        start = text.find("{", end)
    return None


def leaf_values(value: object) -> Iterator[object]:
    """Every scalar inside a JSON value, nested objects and arrays included."""
    if isinstance(value, dict):
        for item in value.values():
            yield from leaf_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from leaf_values(item)
    else:
        yield value


def normalize_key(key: str) -> str:
    """ "Replica Count", "replica_count" and "replicaCount" all become "replicacount"."""
    return "".join(char for char in key.casefold() if char.isalnum())


class _Check(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JsonObjectOnly(_Check):
    """The answer is exactly one JSON object: no text before it (the customer's paraphrase) or after."""

    kind: Literal["json_object_only"] = "json_object_only"

    def describe(self) -> str:
        return "the answer is one JSON object with nothing before or after it"

    def check(self, text: str) -> list[str]:
        found = find_json_object(text)
        if found is None:
            return [f"no JSON object in the answer {excerpt(text)}"]
        _, start, end = found
        problems = []
        if before := text[:start].strip():
            problems.append(f"text before the JSON object: {excerpt(before)}")
        if after := text[end:].strip():
            problems.append(f"text after the JSON object: {excerpt(after)}")
        return problems


class Contains(_Check):
    kind: Literal["contains"] = "contains"
    text: str = Field(min_length=1)
    case_sensitive: bool = False

    def describe(self) -> str:
        return f"the answer contains {self.text!r}"

    def check(self, text: str) -> list[str]:
        if _contains(text, self.text, case_sensitive=self.case_sensitive):
            return []
        return [f"the answer does not contain {self.text!r}"]


class NotContains(_Check):
    kind: Literal["not_contains"] = "not_contains"
    text: str = Field(min_length=1)
    case_sensitive: bool = False

    def describe(self) -> str:
        return f"the answer does not contain {self.text!r}"

    def check(self, text: str) -> list[str]:
        if _contains(text, self.text, case_sensitive=self.case_sensitive):
            return [f"the answer contains {self.text!r}"]
        return []


class JsonValuesInclude(_Check):
    """The first JSON object's leaf values, counted as a multiset, include every listed value."""

    kind: Literal["json_values_include"] = "json_values_include"
    values: list[JsonScalar] = Field(min_length=1)

    def describe(self) -> str:
        return f"the JSON object's values include {_listing(self.values)}"

    def check(self, text: str) -> list[str]:
        found = find_json_object(text)
        if found is None:
            return [f"no JSON object to find {_listing(self.values)} in"]
        have = Counter(canonical(value) for value in leaf_values(found[0]))
        want = Counter(canonical(value) for value in self.values)
        problems = []
        for value in _unique(self.values):
            count, needed = have[canonical(value)], want[canonical(value)]
            if count == 0:
                problems.append(f"the JSON object holds no value {_show(value)}")
            elif count < needed:
                problems.append(f"the JSON object holds {_show(value)} {count}x, expected {needed}x")
        return problems


class JsonValuesExclude(_Check):
    """None of the first JSON object's leaf values equals a listed value (superseded values)."""

    kind: Literal["json_values_exclude"] = "json_values_exclude"
    values: list[JsonScalar] = Field(min_length=1)

    def describe(self) -> str:
        return f"the JSON object's values include none of {_listing(self.values)}"

    def check(self, text: str) -> list[str]:
        found = find_json_object(text)
        if found is None:
            return []
        have = {canonical(value) for value in leaf_values(found[0])}
        present = [value for value in _unique(self.values) if canonical(value) in have]
        return [f"the JSON object holds the excluded value {_show(value)}" for value in present]


class JsonFieldEquals(_Check):
    """Every top-level key whose normalized name contains `field` holds `value`; at least one exists."""

    kind: Literal["json_field_equals"] = "json_field_equals"
    field: str = Field(min_length=1)
    value: JsonScalar

    def describe(self) -> str:
        return f"the JSON field named like {self.field!r} equals {_show(self.value)}"

    def check(self, text: str) -> list[str]:
        found = find_json_object(text)
        if found is None:
            return [f"no JSON object to find the field {self.field!r} in"]
        wanted = normalize_key(self.field)
        matching = {key: value for key, value in found[0].items() if wanted in normalize_key(key)}
        if not matching:
            return [f"the JSON object has no field named like {self.field!r} (keys: {sorted(found[0])})"]
        return [
            f"the JSON field {key!r} is {_show(value)}, expected {_show(self.value)}"
            for key, value in matching.items()
            if canonical(value) != canonical(self.value)
        ]


Expectation = Annotated[
    JsonObjectOnly | Contains | NotContains | JsonValuesInclude | JsonValuesExclude | JsonFieldEquals,
    Field(discriminator="kind"),
]


def violations(expectations: list[Expectation], text: str) -> list[str]:
    """Every expectation `text` breaks, one line each, in the order the expectations are listed."""
    return [problem for expectation in expectations for problem in expectation.check(text)]


def _contains(text: str, needle: str, *, case_sensitive: bool) -> bool:
    return needle in text if case_sensitive else needle.casefold() in text.casefold()


def _unique(values: list[JsonScalar]) -> list[JsonScalar]:
    seen: set[tuple[str, object]] = set()
    unique = []
    for value in values:
        if canonical(value) not in seen:
            seen.add(canonical(value))
            unique.append(value)
    return unique


def _show(value: object) -> str:
    return json.dumps(value)


def _listing(values: list[JsonScalar]) -> str:
    return ", ".join(_show(value) for value in values)
