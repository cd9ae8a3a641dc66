"""The canary's knowledge of vLLM, checked against the installed engine (engine tier).

`expected_external_hit_tokens` must equal what vLLM's own MooncakeStore lookup returns, and the
metric names the canary reads must be the ones vLLM registers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from mooncake_operator.canary import metrics as canary_metrics
from mooncake_operator.canary.metrics import expected_external_hit_tokens

pytestmark = pytest.mark.engine

STORE_DIR = Path("distributed/kv_transfer/kv_connector/v1/mooncake/store")

# Runs in the engine venv: vLLM's real MooncakeStoreWorker.lookup over its real coordinator, with
# a store that holds every full block of the prompt (what the writer saved). Only the store and the
# worker's plumbing are stand-ins.
LOOKUP_PROBE = """
import json, sys
from types import SimpleNamespace
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

def lookup(prompt_tokens, block_size, eagle):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["layers.0.attn"], spec)]
    coordinator = MooncakeStoreCoordinator(groups, block_size, block_size, use_eagle=eagle)
    hashes = [index.to_bytes(4, "big") * 8 for index in range(prompt_tokens // block_size)]
    stored = {block.hex() for block in hashes}
    worker = SimpleNamespace(
        _capacity_only=False,
        coord=coordinator,
        token_dbs=[SimpleNamespace(block_size=block_size)],
        _kv_cache_groups=groups,
        _lookup_key_prefixes=[["probe"]],
        store=SimpleNamespace(batch_is_exist=lambda keys: [int(k.split("@")[-1] in stored) for k in keys]),
        _record_kv_connector_operation=lambda *args, **kwargs: None,
        hash_block_size=block_size,
        _tail_key_boundaries=lambda *args: (),
    )
    return MooncakeStoreWorker.lookup(worker, prompt_tokens, hashes).hit_length

print(json.dumps([lookup(*case) for case in json.loads(sys.argv[1])]))
"""


@pytest.fixture(scope="module")
def engine_python() -> Path:
    root = os.environ.get("MOONCAKE_OPERATOR_CACHE") or str(Path.home() / ".cache" / "mooncake-operator")
    python = Path(root) / "engine-venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"engine venv missing ({python}); create it with `mooncake-operator sandbox prepare`",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="module")
def vllm_dir(engine_python: Path) -> Path:
    found = subprocess.run(
        [str(engine_python), "-c", "import os, vllm; print(os.path.dirname(vllm.__file__))"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    return Path(found.stdout.strip().splitlines()[-1])


def test_expected_hit_equals_vllms_own_lookup(engine_python: Path) -> None:
    measured = (168, 32, True)  # the customer's request on the tiny tokenizer (e2e tier)
    cases = [measured, (185, 32, True), (185, 16, True)] + [
        (prompt_tokens, block_size, eagle)
        for block_size in (16, 32)
        for eagle in (True, False)
        for prompt_tokens in range(1, 4 * block_size + 2)
    ]
    probe = subprocess.run(
        [str(engine_python), "-c", LOOKUP_PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    vllm_hits = json.loads(probe.stdout.strip().splitlines()[-1])
    ours = [expected_external_hit_tokens(p, b, eagle=e) for p, b, e in cases]
    differing = [
        (case, theirs, mine)
        for case, theirs, mine in zip(cases, vllm_hits, ours, strict=True)
        if theirs != mine
    ]
    assert differing == []
    assert vllm_hits[0] == 128


def test_metric_names_and_labels_are_vllms(vllm_dir: Path) -> None:
    registered = set()
    for source in (vllm_dir / "v1/metrics/loggers.py", vllm_dir / STORE_DIR / "metrics.py"):
        registered |= set(re.findall(r'name="(vllm:[a-z_:]+)"', source.read_text()))
    for name in (
        canary_metrics.EXTERNAL_HITS,
        canary_metrics.EXTERNAL_QUERIES,
        canary_metrics.LOCAL_HITS,
        canary_metrics.PROMPT_TOKENS_BY_SOURCE,
        canary_metrics.STORE_OPERATION_KEYS,
        canary_metrics.STORE_FAILED_KEYS,
    ):
        # prometheus_client appends _total to counters; some vLLM names already carry it.
        assert name in registered or name.removesuffix("_total") in registered, name
    store_metrics = (vllm_dir / STORE_DIR / "metrics.py").read_text()
    assert 'labelnames + ["operation", "status"]' in store_metrics
    worker = (vllm_dir / STORE_DIR / "worker.py").read_text()
    assert '"load_get"' in worker and '"save_put"' in worker
    stats = (vllm_dir / "v1/metrics/stats.py").read_text()
    assert '"external_kv_transfer"' in stats and '"local_cache_hit"' in stats
