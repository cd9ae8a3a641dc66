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

A key repeated in an object (`"region": "us-east", "region": "us-west"`) is a violation of every list
holding a JSON check: a parser keeps the last value, so the answer's old value would otherwise hide
behind the new one (the seed's symptom is old values mixed with new). The values a repeat shadows are
still values of the object, so `json_values_exclude` sees them too.

Checks judge the answer after any reasoning (`answer_text`).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

JsonScalar = str | int | float | bool | None

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_EXCERPT_CHARS = 80
_LISTED_KEYS = 10  # keys (or mismatching fields) named in one violation


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


# Bounds on the search for the answer's JSON object, so an answer of `{` repeated, or one huge or deeply
# nested object, costs a bounded time whatever its length: at most this many `{` are tried, each
# decoded within a window of this many characters (one decode holds the GIL: at 64 Ki characters it
# is tens of milliseconds), and the search stops at the deadline. An object longer than the window is
# not checked: the answer fails its JSON checks with that reason.
JSON_SEARCH_ATTEMPTS = 32
JSON_OBJECT_MAX_CHARS = 64 * 1024
JSON_SEARCH_BUDGET_S = 2.0


@dataclass(frozen=True)
class JsonSearch:
    """The first JSON object of an answer; when None, `gave_up` says why not every candidate was tried."""

    found: tuple[dict[str, object], int, int] | None
    gave_up: str = ""

    def missing(self) -> str:
        """ "no JSON object" plus why the search stopped, when it did not look at every candidate."""
        return f"no JSON object ({self.gave_up})" if self.gave_up else "no JSON object"


class JsonObject(dict[str, object]):
    """A decoded JSON object that remembers what its repeated keys held before (the last value wins)."""

    shadowed: list[tuple[str, object]]


def _json_object(pairs: list[tuple[str, object]]) -> JsonObject:
    obj = JsonObject()
    obj.shadowed = []
    for key, value in pairs:
        if key in obj:
            obj.shadowed.append((key, obj[key]))
        obj[key] = value
    return obj


def repeated_keys(value: object) -> list[tuple[str, list[object]]]:
    """Every key an object inside `value` repeats, with all its values in order (iterative: any depth)."""
    found = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, JsonObject):
            for key in dict.fromkeys(key for key, _ in item.shadowed):
                earlier = [old for name, old in item.shadowed if name == key]
                found.append((key, [*earlier, item[key]]))
        if isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            pending.extend(reversed(item))
    return found


# Where the reasoning of a model that thinks before it answers ends (MiniMax-M2, Qwen3, DeepSeek-R1):
# without a reasoning parser vLLM returns it inside the content, `…</think>\n\n{json}`.
REASONING_END = "</think>"


def answer_text(content: str | None, reasoning: str | None) -> str:
    """The answer the checks judge: the content after the reasoning. With a reasoning parser vLLM has
    split it off already (`reasoning` is set; `content` null when the answer was not reached); without
    one, the content is cut after its first end-of-reasoning marker."""
    text = content or ""
    if reasoning is not None:
        return text
    end = text.find(REASONING_END)
    return text[end + len(REASONING_END) :] if end != -1 else text


def value_agnostic(expectations: list[Expectation]) -> list[Expectation]:
    """The checks that hold for any request asking for one JSON object, whatever the values: the default
    suite's padded requests are judged by these (and by the repeated-key rule they bring)."""
    return [expectation for expectation in expectations if isinstance(expectation, JsonObjectOnly)]


def find_json_object(text: str) -> tuple[dict[str, object], int, int] | None:
    """The first JSON object in `text` as (object, start, end), or None (see `search_json`)."""
    return search_json(text).found


def search_json(
    text: str,
    *,
    attempts: int = JSON_SEARCH_ATTEMPTS,
    max_chars: int = JSON_OBJECT_MAX_CHARS,
    budget_s: float = JSON_SEARCH_BUDGET_S,
) -> JsonSearch:
    """The first `{` from which a JSON object decodes, trying at most `attempts` of them, each within
    `max_chars` characters, for at most `budget_s` seconds: linear in `text` and bounded in time."""
    decoder = json.JSONDecoder(object_pairs_hook=_json_object)
    deadline = time.monotonic() + budget_s
    start = text.find("{")
    tried = 0
    too_long = None
    while start != -1:
        if tried == attempts:
            return JsonSearch(None, f"gave up after {attempts} places that start with '{{'")
        if time.monotonic() > deadline:
            return JsonSearch(None, f"gave up after {budget_s:g} s")
        tried += 1
        # Decode a bounded window: the cost of one attempt (and of the error's line count) is bounded.
        window = text[start : start + max_chars]
        try:
            value, length = decoder.raw_decode(window)
        except json.JSONDecodeError as error:
            if error.pos >= len(window) - 1 and len(window) == max_chars and too_long is None:
                too_long = start
            start = text.find("{", start + 1)
            continue
        except RecursionError:  # nested deeper than the interpreter allows: not an answer to check
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            return JsonSearch((value, start, start + length))
        start = text.find("{", start + length)
    if too_long is not None:
        return JsonSearch(
            None, f"the one at character {too_long} is longer than {max_chars} characters, not checked"
        )
    return JsonSearch(None)


def leaf_values(value: object) -> Iterator[object]:
    """Every scalar inside a JSON value, nested objects and arrays included (iterative: any depth)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            shadowed = [old for _, old in item.shadowed] if isinstance(item, JsonObject) else []
            pending.extend(reversed([*shadowed, *item.values()]))
        elif isinstance(item, list):
            pending.extend(reversed(item))
        else:
            yield item


def normalize_key(key: str) -> str:
    """ "Replica Count", "replica_count" and "replicaCount" all become "replicacount"."""
    return "".join(char for char in key.casefold() if char.isalnum())


class _Check(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JsonObjectOnly(_Check):
    """The answer is exactly one JSON object: no text before it (the paraphrase the bug produced) or after."""

    kind: Literal["json_object_only"] = "json_object_only"

    def describe(self) -> str:
        return "the answer is one JSON object with nothing before or after it"

    def check(self, text: str, search: JsonSearch | None = None) -> list[str]:
        search = search or search_json(text)
        found = search.found
        if found is None:
            return [f"{search.missing()} in the answer {excerpt(text)}"]
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

    def check(self, text: str, search: JsonSearch | None = None) -> list[str]:
        if _contains(text, self.text, case_sensitive=self.case_sensitive):
            return []
        return [f"the answer does not contain {self.text!r}"]


class NotContains(_Check):
    kind: Literal["not_contains"] = "not_contains"
    text: str = Field(min_length=1)
    case_sensitive: bool = False

    def describe(self) -> str:
        return f"the answer does not contain {self.text!r}"

    def check(self, text: str, search: JsonSearch | None = None) -> list[str]:
        if _contains(text, self.text, case_sensitive=self.case_sensitive):
            return [f"the answer contains {self.text!r}"]
        return []


class JsonValuesInclude(_Check):
    """The first JSON object's leaf values, counted as a multiset, include every listed value."""

    kind: Literal["json_values_include"] = "json_values_include"
    values: list[JsonScalar] = Field(min_length=1)

    def describe(self) -> str:
        return f"the JSON object's values include {_listing(self.values)}"

    def check(self, text: str, search: JsonSearch | None = None) -> list[str]:
        search = search or search_json(text)
        found = search.found
        if found is None:
            return [f"{search.missing()} to find {_listing(self.values)} in"]
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

    def check(self, text: str, search: JsonSearch | None = None) -> list[str]:
        found = (search or search_json(text)).found
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

    def check(self, text: str, search: JsonSearch | None = None) -> list[str]:
        search = search or search_json(text)
        found = search.found
        if found is None:
            return [f"{search.missing()} to find the field {self.field!r} in"]
        wanted = normalize_key(self.field)
        matching = {key: value for key, value in found[0].items() if wanted in normalize_key(key)}
        if not matching:
            return [f"the JSON object has no field named like {self.field!r} (keys: {_keys(found[0])})"]
        return [
            f"the JSON field {excerpt(key)} is {_show(value)}, expected {_show(self.value)}"
            for key, value in matching.items()
            if canonical(value) != canonical(self.value)
        ][:_LISTED_KEYS]


Expectation = Annotated[
    JsonObjectOnly | Contains | NotContains | JsonValuesInclude | JsonValuesExclude | JsonFieldEquals,
    Field(discriminator="kind"),
]


_JSON_CHECKS = (JsonObjectOnly, JsonValuesInclude, JsonValuesExclude, JsonFieldEquals)


def violations(expectations: list[Expectation], text: str) -> list[str]:
    """Every expectation `text` breaks, one line each, in the order the expectations are listed; then,
    when any check reads the JSON object, each key it repeats."""
    search = search_json(text) if expectations else None  # once for every JSON check
    problems = [problem for expectation in expectations for problem in expectation.check(text, search)]
    if (
        search is not None
        and search.found is not None
        and any(isinstance(expectation, _JSON_CHECKS) for expectation in expectations)
    ):
        problems += [
            f"the JSON object repeats the key {excerpt(key, 40)} "
            f"({', '.join(_show(value) for value in values[:_LISTED_KEYS])}): "
            "a superseded value may hide behind the last one"
            for key, values in repeated_keys(search.found[0])[:_LISTED_KEYS]
        ]
    return problems


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
    """A value as JSON, shortened: an answer's values end up in the resource's status."""
    shown = json.dumps(value)
    return shown if len(shown) <= _EXCERPT_CHARS else shown[:_EXCERPT_CHARS] + "…"


def _keys(obj: dict[str, object]) -> str:
    """The first keys, each shortened, and how many more: an answer may hold any number of any length."""
    keys = sorted(obj)
    listed = "[" + ", ".join(excerpt(key, 40) for key in keys[:_LISTED_KEYS]) + "]"
    return listed + (f" and {len(keys) - _LISTED_KEYS} more" if len(keys) > _LISTED_KEYS else "")


def _listing(values: list[JsonScalar]) -> str:
    return ", ".join(_show(value) for value in values)
