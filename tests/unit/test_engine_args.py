"""The engine command line: production equals the customer's `vllm serve` arguments item by item."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from tests.unit.customer_seed import CUSTOMER_ARGV, CUSTOMER_ENV, CUSTOMER_STORE_JSON

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.engine_args import (
    SandboxSubstitutions,
    describe_substitutions,
    evidence_args,
    kv_fingerprint,
    kv_shaping_args,
    master_argv,
    replica_launch,
)
from mooncake_operator.canary.evidence import PER_REQUEST_FLAG, PER_REQUEST_SPEC_FLAG

pytestmark = pytest.mark.unit

# The customer's command with the one change inside a flag: the store's load-failure policy, explicit
# (vLLM's default, "fail"), appended to --kv-transfer-config's JSON after the customer's keys.
KV_AT = CUSTOMER_ARGV.index("--kv-transfer-config") + 1
THEIR_KV = json.loads(CUSTOMER_ARGV[KV_AT])
OUR_KV = {**THEIR_KV, "kv_load_failure_policy": "fail"}
OUR_ARGV = (*CUSTOMER_ARGV[:KV_AT], json.dumps(OUR_KV, separators=(",", ":")), *CUSTOMER_ARGV[KV_AT + 1 :])
EVIDENCE_WITH_EAGLE = ("--enable-prompt-tokens-details", "--per-request-spec-decode-metrics", "summary")
# The engine finishes in-flight requests on SIGTERM and closes its store client (a clean unmount).
DRAIN = ("--shutdown-timeout", "20")


def spec(*, isolate_revisions: bool = False) -> MooncakeServingSpec:
    """The customer's deployment; without the store isolation (default on) it is their command verbatim."""
    base = reference_deployment().spec
    store = base.store.model_copy(update={"isolate_revisions": isolate_revisions})
    return base.model_copy(update={"store": store})


def test_production_argv_equals_the_customers_item_by_item() -> None:
    launch = replica_launch(spec(), master_address="10.0.0.10:50051", port=8000)
    assert launch.argv[: len(OUR_ARGV)] == OUR_ARGV
    ours = (*EVIDENCE_WITH_EAGLE, *DRAIN, "--host", "0.0.0.0", "--port", "8000")
    assert launch.argv[len(OUR_ARGV) :] == ours


def test_every_answer_carries_its_own_evidence_for_the_canary() -> None:
    """The flags the canary's per-request proof reads, from the canary's own constants."""
    assert (PER_REQUEST_FLAG, *PER_REQUEST_SPEC_FLAG.split()) == EVIDENCE_WITH_EAGLE
    argv = replica_launch(spec(), master_address="m:1").argv
    assert argv.count(PER_REQUEST_FLAG) == 1
    at = argv.index("--per-request-spec-decode-metrics")
    assert argv[at + 1] == "summary"
    assert argv.index("--speculative-config") < at < argv.index("--host")


def test_without_a_draft_there_is_no_spec_decode_evidence_flag() -> None:
    # vLLM 0.32 refuses --per-request-spec-decode-metrics without --speculative-config.
    plain = spec().model_copy(update={"speculative": None})
    for substitutions in (None, SANDBOX):
        argv = replica_launch(plain, master_address="m:1", substitutions=substitutions).argv
        assert PER_REQUEST_FLAG in argv
        assert not any(arg.startswith("--per-request-spec-decode-metrics") for arg in argv)
        assert argv[argv.index(PER_REQUEST_FLAG) + 1] == DRAIN[0]


def test_store_isolation_is_on_by_default_and_adds_only_the_cache_prefix() -> None:
    assert reference_deployment().spec.store.isolate_revisions
    isolated = spec(isolate_revisions=True)
    argv = replica_launch(isolated, master_address="m:1").argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == {
        **OUR_KV,
        "kv_connector_extra_config": {
            **OUR_KV["kv_connector_extra_config"],
            "cache_prefix": kv_fingerprint(isolated),
        },
    }
    plain = replica_launch(spec(), master_address="m:1").argv
    assert [a for a in argv if not a.startswith("{")] == [a for a in plain if not a.startswith("{")]


def test_json_flags_have_the_customers_keys_values_and_order() -> None:
    argv = replica_launch(spec(), master_address="m:1").argv
    for flag in ("--kv-transfer-config", "--speculative-config"):
        ours = list(json.loads(argv[argv.index(flag) + 1]).items())
        theirs = list(json.loads(CUSTOMER_ARGV[CUSTOMER_ARGV.index(flag) + 1]).items())
        assert ours[: len(theirs)] == theirs
        added = [("kv_load_failure_policy", "fail")] if flag == "--kv-transfer-config" else []
        assert ours[len(theirs) :] == added


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_load_failure_policy_is_a_top_level_kv_transfer_field(policy: str) -> None:
    # vLLM 0.32 reads KVTransferConfig.kv_load_failure_policy in its scheduler, not in the connector's
    # extra config; a key there would be ignored.
    base = spec()
    custom = base.model_copy(update={"store": base.store.model_copy(update={"load_failure_policy": policy})})
    argv = replica_launch(custom, master_address="m:1").argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_load_failure_policy"] == policy
    assert "kv_load_failure_policy" not in config["kv_connector_extra_config"]
    assert kv_fingerprint(custom) == kv_fingerprint(base)  # the blocks mean the same either way


def test_the_load_failure_policy_defaults_to_vllms_fail_and_refuses_others() -> None:
    assert reference_deployment().spec.store.load_failure_policy == "fail"
    document = reference_deployment().spec.to_wire()
    document["store"]["loadFailurePolicy"] = "ignore"
    with pytest.raises(ValueError, match="loadFailurePolicy"):
        MooncakeServingSpec.model_validate(document)


def test_environment_is_the_customers() -> None:
    assert dict(replica_launch(spec(), master_address="m:1").env) == CUSTOMER_ENV


def test_store_config_equals_the_customers_key_by_key() -> None:
    config: Mapping[str, Any] = replica_launch(spec(), master_address="10.0.0.10:50051").store_config
    theirs = json.loads(CUSTOMER_STORE_JSON)
    assert list(config.items()) == list(theirs.items())
    assert json.dumps(dict(config), indent=2) == CUSTOMER_STORE_JSON


def test_extra_args_follow_host_and_port() -> None:
    base = spec()
    custom = base.model_copy(
        update={"engine": base.engine.model_copy(update={"extra_args": ["--enable-prompt-embeds"]})}
    )
    argv = replica_launch(custom, master_address="m:1", host="127.0.0.1", port=8123).argv
    assert argv[-5:] == ("--host", "127.0.0.1", "--port", "8123", "--enable-prompt-embeds")
    assert argv[-10:-5] == (*evidence_args(custom), *DRAIN)


def test_load_async_goes_into_the_connector_extra_config() -> None:
    base = spec()
    custom = base.model_copy(update={"store": base.store.model_copy(update={"load_async": False})})
    argv = replica_launch(custom, master_address="m:1").argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"] == {"load_async": False}
    assert "load_async" not in replica_launch(custom, master_address="m:1").store_config


def test_without_speculative_config_there_is_no_speculative_flag() -> None:
    base = spec()
    plain = base.model_copy(update={"speculative": None})
    argv = replica_launch(plain, master_address="m:1").argv
    assert "--speculative-config" not in argv
    assert argv[: len(OUR_ARGV) - 2] == OUR_ARGV[:-2]


def test_other_entrypoints_take_the_model_as_an_option() -> None:
    entry = ("python", "-m", "vllm.entrypoints.openai.api_server")
    argv = replica_launch(spec(), master_address="m:1", entrypoint=entry).argv
    assert argv[:5] == (*entry, "--model", "MiniMaxAI/MiniMax-M2.5")


SANDBOX = SandboxSubstitutions(model_path="/tmp/models/target", draft_model_path="/tmp/models/draft")


def test_sandbox_argv_substitutes_only_what_a_cpu_forces() -> None:
    entry = ("python", "-m", "vllm.entrypoints.openai.api_server")
    launch = replica_launch(
        spec(),
        master_address="127.0.0.1:50051",
        host="127.0.0.1",
        port=8100,
        entrypoint=entry,
        substitutions=SANDBOX,
    )
    kv = OUR_ARGV[KV_AT]
    assert launch.argv == (
        *entry,
        "--model",
        "/tmp/models/target",
        "--served-model-name",
        "MiniMaxAI/MiniMax-M2.5",
        "--trust-remote-code",
        "--tensor-parallel-size",
        "1",
        "--max-model-len",
        "4096",
        "--block-size",
        "32",
        "--enforce-eager",
        "--kv-transfer-config",
        kv,
        "--speculative-config",
        '{"method":"eagle3","model":"/tmp/models/draft","num_speculative_tokens":3,"draft_tensor_parallel_size":1}',
        *EVIDENCE_WITH_EAGLE,
        *DRAIN,
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
    )
    assert dict(launch.env) == CUSTOMER_ENV
    assert dict(launch.store_config) == {
        **json.loads(CUSTOMER_STORE_JSON),
        "master_server_address": "127.0.0.1:50051",
        "global_segment_size": "512MB",
        "local_buffer_size": "128MB",
    }


def test_sandbox_max_model_len_substitution() -> None:
    sub = SandboxSubstitutions(
        model_path="/m", draft_model_path="/d", max_model_len=1024, enforce_eager=False
    )
    argv = replica_launch(spec(), master_address="m:1", substitutions=sub).argv
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert "--enforce-eager" not in argv


def test_sandbox_without_a_draft_for_an_eagle_spec_is_an_error() -> None:
    sub = SandboxSubstitutions(model_path="/m", draft_model_path=None)
    with pytest.raises(ValueError, match="draft_model_path"):
        replica_launch(spec(), master_address="m:1", substitutions=sub)


def test_sandbox_without_speculative_ignores_the_draft() -> None:
    plain = spec().model_copy(update={"speculative": None})
    argv = replica_launch(plain, master_address="m:1", substitutions=SANDBOX).argv
    assert "--speculative-config" not in argv


def test_describe_substitutions_names_every_change() -> None:
    lines = describe_substitutions(spec(), SANDBOX)
    assert lines == [
        "model: MiniMaxAI/MiniMax-M2.5 @ f710177d938eff80b684d42c5aa84b382612f21f -> /tmp/models/target "
        "(served as MiniMaxAI/MiniMax-M2.5)",
        "tokenizer revision: f710177d938eff80b684d42c5aa84b382612f21f -> (none: local directory)",
        "draft model: thoughtworks/MiniMax-M2.5-Eagle3 @ fb4699b3d33913e6b5e2462dd7962775e44e5fea "
        "-> /tmp/models/draft",
        "tensor-parallel-size: 4 -> 1",
        "block-size: 16 -> 32",
        "enforce-eager: False -> True",
        "global_segment_size: 80GB -> 512MB",
        "local_buffer_size: 4GB -> 128MB",
    ]


def test_master_argv_defaults_and_overrides() -> None:
    assert master_argv(spec()) == (
        "mooncake_master",
        "-rpc_address=0.0.0.0",
        "-rpc_port=50051",
        "-metrics_host=0.0.0.0",
        "-metrics_port=9003",
    )
    argv = master_argv(
        spec(),
        rpc_address="127.0.0.1",
        rpc_port=6001,
        metrics_host="127.0.0.1",
        metrics_port=6002,
        executable="/venv/bin/mooncake_master",
    )
    assert argv == (
        "/venv/bin/mooncake_master",
        "-rpc_address=127.0.0.1",
        "-rpc_port=6001",
        "-metrics_host=127.0.0.1",
        "-metrics_port=6002",
    )
    assert not any("http_metadata" in arg for arg in argv)


def test_master_argv_passes_the_store_timeouts_only_when_set() -> None:
    base = spec()
    master = base.store.master.model_copy(update={"client_ttl_seconds": 60, "kv_lease_ttl_seconds": 120})
    tuned = base.model_copy(update={"store": base.store.model_copy(update={"master": master})})
    assert master_argv(tuned)[-2:] == ("-client_ttl=60", "-default_kv_lease_ttl=120s")
    assert not any("ttl" in arg for arg in master_argv(base))  # unset: Mooncake's own defaults


# --- the KV-compatibility fingerprint (store isolation) ------------------------------------------------


def _changed(path: str, value: object) -> MooncakeServingSpec:
    """The customer's spec with one (camelCase, dotted) field changed, validated like the API does."""
    document = reference_deployment().spec.to_wire()
    *parents, leaf = path.split(".")
    node = document
    for key in parents:
        node = node[key]
    node[leaf] = value
    return MooncakeServingSpec.model_validate(document)


KV_CHANGES = {
    "model name": ("model.name", "MiniMaxAI/MiniMax-M2.6"),
    "model revision": ("model.revision", "0" * 40),
    "tokenizer revision": ("model.tokenizerRevision", "1" * 40),
    "engine image": ("engine.image", "registry.example/vllm-mooncake:other"),
    "tensor parallel size": ("engine.tensorParallelSize", 8),
    "block size": ("engine.blockSize", 32),
    "hash seed": ("engine.pythonHashSeed", 1),
    "draft model": ("speculative.model", "someone/other-eagle3"),
    "draft revision": ("speculative.revision", "2" * 40),
    "dtype": ("engine.extraArgs", ["--dtype", "float16"]),
    "dtype (=)": ("engine.extraArgs", ["--dtype=float16"]),
    "kv cache dtype": ("engine.extraArgs", ["--kv-cache-dtype", "fp8"]),
    "kv cache dtype (underscores)": ("engine.extraArgs", ["--kv_cache_dtype=fp8"]),
    "quantization": ("engine.extraArgs", ["--quantization", "fp8"]),
    "quantization (-q)": ("engine.extraArgs", ["-q", "fp8"]),
    "hash algorithm": ("engine.extraArgs", ["--prefix-caching-hash-algo", "sha256_cbor"]),
    "hf overrides": ("engine.extraArgs", ['--hf-overrides={"rope_theta": 1}']),
}


@pytest.mark.parametrize("change", sorted(KV_CHANGES))
def test_each_kv_shaping_input_changes_the_fingerprint(change: str) -> None:
    path, value = KV_CHANGES[change]
    assert kv_fingerprint(_changed(path, value)) != kv_fingerprint(reference_deployment().spec)


def test_dropping_the_draft_changes_the_fingerprint() -> None:
    base = reference_deployment().spec
    assert kv_fingerprint(base.model_copy(update={"speculative": None})) != kv_fingerprint(base)


IRRELEVANT = {
    "replicas": ("replicas", 7),
    "canary pairs": ("canary.pairs", "first"),
    "canary on failure": ("canary.onFailure", "Rollback"),
    "draft token count": ("speculative.numSpeculativeTokens", 5),
    "store segment size": ("store.globalSegmentSize", "40GB"),
    "load async": ("store.loadAsync", False),
    "engine port": ("engine.port", 8001),
    "batching extra arg": ("engine.extraArgs", ["--max-num-seqs", "64", "--enable-prompt-embeds"]),
}


@pytest.mark.parametrize("change", sorted(IRRELEVANT))
def test_inputs_that_keep_blocks_compatible_keep_the_fingerprint(change: str) -> None:
    path, value = IRRELEVANT[change]
    assert kv_fingerprint(_changed(path, value)) == kv_fingerprint(reference_deployment().spec)


def test_the_fingerprint_is_stable_and_a_valid_key_prefix() -> None:
    # Stable across processes and releases: a changed value would orphan every warm store on upgrade.
    value = kv_fingerprint(reference_deployment().spec)
    assert value == kv_fingerprint(reference_deployment().spec)
    assert value.startswith("kv-") and len(value) == 19 and "@" not in value


def test_kv_shaping_args_keep_flags_with_their_values_only() -> None:
    args = ["--max-num-seqs", "8", "--dtype", "half", "--enable-chunked-prefill", "--kv-cache-dtype=fp8", "x"]
    assert kv_shaping_args(args) == ["--dtype", "half", "--kv-cache-dtype=fp8"]
    assert kv_shaping_args(["--kv-cache-dt", "fp8"]) == ["--kv-cache-dt", "fp8"]  # vLLM's abbreviation
