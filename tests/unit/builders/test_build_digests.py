"""build/digests.py: the content digests things are named by (exact values)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES
from tests.unit.builders.golden import assert_golden

from mooncake_operator.build.digests import canonical_json, json_digest, short_digest, spec_hash

pytestmark = pytest.mark.unit


def test_digests_are_exact() -> None:
    assert short_digest("") == "e3b0c44298fc1c14"  # SHA-256 of nothing, 16 hex digits
    assert canonical_json({"b": [1, {"d": 2, "c": 3}], "a": "x"}) == '{"a":"x","b":[1,{"c":3,"d":2}]}'
    assert json_digest({"b": 1, "a": 2}) == json_digest({"a": 2, "b": 1}) == short_digest('{"a":2,"b":1}')


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_hash(case: str) -> None:
    spec = CASES[case]().spec
    assert spec_hash(spec) == json_digest(spec.to_wire())
    assert_golden("digests", case, {"specHash": spec_hash(spec)})
