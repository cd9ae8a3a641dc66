"""A model revision change on real engines: is the new revision served the old revision's KV blocks?

`mooncake-operator sandbox --scenario revision-change` starts two vLLM replicas of revision 1 on one real
master; both serve a request WITHOUT a cache salt (the second loads the first's prefix from the store);
the second moves to revision 2 (other weights, a directory of the same basename, which is all vLLM puts
of the model into a store key). The same unsalted request to it is compared with its own cold answer.
With the store isolation (the default: `cache_prefix` = the KV fingerprint) it loads nothing and answers
as cold; without it, it loads revision 1's blocks and serves a stale answer (exit 1).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.support.cpu_stalls import stalled_during_test
from tests.support.sandbox_command import run_sandbox_json

from mooncake_sandbox import Prepared

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def run(isolation: str) -> tuple[int, dict[str, Any]]:
    code, outcome, stderr = run_sandbox_json("--scenario", "revision-change", "--store-isolation", isolation)
    assert "revision_change" in outcome, json.dumps(outcome, indent=1)[-6000:] + stderr[-3000:]
    change = outcome["revision_change"]
    print(f"revision change: {change['summary']} (wall {outcome.get('wall_s')} s)")
    # Both runs start from the same evidence: the revision-1 replicas shared the unsalted prefix.
    assert change["revision_1_shared"]["external_hit_tokens"] > 0, change
    return code, change


# Rerun (reported by pytest) only when a CPU stalled while it ran (tests/support/cpu_stalls.py).
@pytest.mark.flaky(reruns=2, condition=stalled_during_test)
# Slow (CI budget): the KV fingerprint goldens prove a new revision gets a store prefix of its own, and
# the fault tier's scenario 8 rolls a new revision on real pods; this proves the isolation on real engines.
@pytest.mark.slow
def test_with_store_isolation_the_new_revision_reads_nothing_of_the_old(prepared: Prepared) -> None:
    code, change = run("on")

    assert code == 0, change
    assert change["verdict"] == "Passed"
    stale, cold = change["revision_2_unsalted"], change["revision_2_cold"]
    assert stale["external_hit_tokens"] == 0
    assert stale["text"] == cold["text"]
    namespaces = change["key_namespaces"]
    old, new = namespaces["replica-B@revision-1"], namespaces["replica-B@revision-2"]
    assert old.startswith("prefixed kv-") and new.startswith("prefixed kv-") and old != new
    assert namespaces["replica-A@revision-1"] == old


# The control: what the isolation (always on by default) prevents, vLLM's behaviour rather than the
# product's. Slow (scripts/test-slow): the test above proves the product.
@pytest.mark.slow
@pytest.mark.flaky(reruns=2, condition=stalled_during_test)
def test_without_store_isolation_the_new_revision_serves_a_stale_answer(prepared: Prepared) -> None:
    code, change = run("off")

    assert code == 1, change
    assert change["verdict"] == "Failed"
    stale, cold = change["revision_2_unsalted"], change["revision_2_cold"]
    assert stale["external_hit_tokens"] > 0  # revision 1's blocks, loaded by revision 2
    assert stale["text"] != cold["text"]  # the stale answer a user would have been served
    assert cold["external_hit_tokens"] == 0
    assert set(change["key_namespaces"].values()) == {"unprefixed (store isolation off)"}
