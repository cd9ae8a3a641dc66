"""build/manifests.py: every child in apply order, and the YAML stream (exact). The whole rendered
streams are tests/unit/golden/*.yaml (tests/unit/test_render.py)."""

from __future__ import annotations

import pytest
from tests.unit.builders.cases import CASES, OWNER_UID
from tests.unit.builders.golden import assert_golden

from mooncake_operator.build.manifests import render_all, to_yaml_stream

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", sorted(CASES))
def test_apply_order(case: str) -> None:
    children = render_all(CASES[case](), owner_uid=OWNER_UID)
    order = [f"{child['apiVersion']} {child['kind']}/{child['metadata']['name']}" for child in children]
    assert_golden("manifests", case, {"applyOrder": order})


def test_the_stream_keeps_key_order_and_writes_multi_line_strings_as_blocks() -> None:
    manifests = [{"kind": "ConfigMap", "apiVersion": "v1", "data": {"a.json": '{\n  "k": 1\n}\n', "b": "x"}}]
    assert to_yaml_stream(manifests) == (
        '---\nkind: ConfigMap\napiVersion: v1\ndata:\n  a.json: |\n    {\n      "k": 1\n    }\n  b: x\n'
    )
