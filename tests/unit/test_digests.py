"""One definition of the operator's short content digests."""

from __future__ import annotations

import hashlib

import pytest

from mooncake_operator.build.digests import canonical_json, json_digest, short_digest

pytestmark = pytest.mark.unit


def test_a_short_digest_is_the_sha256_prefix_of_the_utf8_text() -> None:
    assert short_digest("é") == hashlib.sha256("é".encode()).hexdigest()[:16]
    assert len(short_digest("")) == 16


def test_equal_values_have_equal_digests_whatever_the_key_order() -> None:
    assert canonical_json({"b": [1, {"d": 2, "c": 3}], "a": None}) == '{"a":null,"b":[1,{"c":3,"d":2}]}'
    assert json_digest({"a": 1, "b": 2}) == json_digest({"b": 2, "a": 1}) != json_digest({"a": 1, "b": 3})
