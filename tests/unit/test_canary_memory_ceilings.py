"""One operator serves every tenant: a resource's canary cannot size the operator's memory. The operator's
ceilings lower what spec.canary asks for, and one answer is held about once, not as bytes, a copy and
the decoded text at the same time."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator

import httpx
import pytest
from tests.support.hostile_http import raw_server, response_head

from mooncake_operator.api import spec as api
from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.canary import policy as canary_policy
from mooncake_operator.canary.client import chat
from mooncake_operator.canary.request import reference_request
from mooncake_operator.cli.main import build_parser
from mooncake_operator.cli.run import settings_from
from mooncake_operator.runtime.settings import OperatorSettings, SettingsError

pytestmark = pytest.mark.unit

MIB = 1024 * 1024
URLS = ["http://a:8000", "http://b:8000"]


def _spec(**canary: object) -> api.MooncakeServingSpec:
    wire = reference_deployment().spec.to_wire()
    wire["canary"] = {**wire["canary"], **canary}
    return api.MooncakeServingSpec.model_validate(wire)


def test_a_spec_asking_for_more_than_the_ceiling_gets_the_ceiling() -> None:
    spec = _spec(maxChatBodyBytes=1024 * MIB, maxMetricsBodyBytes=1024 * MIB)
    config, notes = OperatorSettings().limit_canary(canary_policy.canary_config(spec, URLS))
    assert (config.max_chat_body_bytes, config.max_metrics_body_bytes) == (16 * MIB, 32 * MIB)
    assert notes == [
        "spec.canary.maxChatBodyBytes 1073741824 lowered to the operator's ceiling 16777216 "
        "(--canary-max-chat-body-bytes)",
        "spec.canary.maxMetricsBodyBytes 1073741824 lowered to the operator's ceiling 33554432 "
        "(--canary-max-metrics-body-bytes)",
    ]


def test_caps_under_the_ceiling_and_the_defaults_are_kept() -> None:
    low = OperatorSettings(canary_max_chat_body_bytes=2 * MIB)
    config, notes = low.limit_canary(canary_policy.canary_config(_spec(maxChatBodyBytes=MIB), URLS))
    assert (config.max_chat_body_bytes, notes) == (MIB, [])
    config, notes = OperatorSettings().limit_canary(canary_policy.canary_config(_spec(), URLS))
    assert (config.max_chat_body_bytes, config.max_metrics_body_bytes, notes) == (4 * MIB, 16 * MIB, [])
    # A ceiling under the default cap lowers the default too.
    config, notes = low.limit_canary(canary_policy.canary_config(_spec(), URLS))
    assert config.max_chat_body_bytes == 2 * MIB and len(notes) == 1


def test_ceilings_are_run_flags_and_validated() -> None:
    args = build_parser().parse_args(
        ["run", "--canary-max-chat-body-bytes", "2097152", "--canary-max-metrics-body-bytes", "4194304"]
    )
    settings = settings_from(args)
    assert (settings.canary_max_chat_body_bytes, settings.canary_max_metrics_body_bytes) == (2 * MIB, 4 * MIB)
    with pytest.raises(SettingsError, match="canary-max-chat-body-bytes must be between 1024 and"):
        OperatorSettings(canary_max_chat_body_bytes=2 * 1024 * MIB)


def _chat_body(content: str) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    payload = {"model": reference_request()["model"], "choices": [choice], "usage": {"prompt_tokens": 1}}
    return json.dumps(payload).encode()


async def test_one_answer_is_held_about_once_while_read_and_parsed() -> None:
    body = _chat_body("x" * (4 * MIB))

    def respond(method: str, path: str) -> Iterator[bytes]:
        yield response_head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))})
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    with raw_server(respond) as url:
        async with httpx.AsyncClient(trust_env=False) as client:
            tracemalloc.start()
            try:
                answer = await chat(
                    client, url, reference_request(), cache_salt=None, timeout=60, max_body_bytes=8 * MIB
                )
                held, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert answer.text is not None and len(answer.text) == 4 * MIB
    # Parsing needs the bytes, their decoded text and the answer at once (3x); before, the reader
    # also kept a second copy of the bytes and the whole body decoded for a 500-character excerpt.
    assert peak < 3.5 * len(body), f"peak {peak / MIB:.1f} MiB for a {len(body) / MIB:.1f} MiB body"
    assert held < 1.5 * len(body), f"held {held / MIB:.1f} MiB after the answer was parsed"
