"""vLLM's command-line vocabulary as its parser reads it (the pinned vLLM's `vllm serve`): which
extraArgs set a flag the operator manages, which pass a secret, and the pipeline- and data-parallel
options a replica's GPU count depends on; the environment the operator sets itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mooncake_operator.canary.evidence import PER_REQUEST_FLAG, PER_REQUEST_SPEC_OPTION

# Rendered on every replica so that each canary answer carries its own evidence (build/engine_args.py).
_PER_REQUEST_EVIDENCE = (
    "(the operator renders it on every replica: the canary's per-request proof reads it from each answer; "
    "docs/canary.md)"
)

# Every option string of a managed flag in the pinned vLLM (0.32.0's `vllm serve` parser; aliases such as
# -tp, -sc and --no-trust-remote-code included) and the field it comes from.
MANAGED_ENGINE_FLAGS = {
    "--model": "model.name",
    "--revision": "model.revision",
    "--tokenizer-revision": "model.tokenizerRevision",
    "--trust-remote-code": "model.trustRemoteCode",
    "--no-trust-remote-code": "model.trustRemoteCode",
    "--max-model-len": "model.maxModelLen",
    "--tensor-parallel-size": "engine.tensorParallelSize",
    "-tp": "engine.tensorParallelSize",
    "--block-size": "engine.blockSize",
    "--kv-transfer-config": "store",
    "--speculative-config": "speculative",
    "-sc": "speculative",
    "--host": "(managed by the operator)",
    "--port": "engine.port",
    "--served-model-name": "model.name",
    PER_REQUEST_FLAG: _PER_REQUEST_EVIDENCE,
    "--no-" + PER_REQUEST_FLAG.removeprefix("--"): _PER_REQUEST_EVIDENCE,
    PER_REQUEST_SPEC_OPTION: _PER_REQUEST_EVIDENCE,
    "--shutdown-timeout": "(managed by the operator: the engine's drain on SIGTERM, within pod.drainSeconds' "
    "grace; docs/operator.md)",
    # A config file can set every flag, managed ones included.
    "--config": "(a config file could set managed flags; use the typed fields and extraArgs)",
}
# vLLM options that are themselves a prefix of a managed option: exact matches win over abbreviations.
_EXACT_OPTIONS_PREFIXING_MANAGED = frozenset({"--tokenizer"})


def engine_flag(arg: str) -> str | None:
    """The option an extraArgs item names, as vLLM's FlexibleArgumentParser reads it, or None for a value.

    It splits `--flag=value`, turns underscores into dashes between `--` and the first `.`, and treats
    `--flag.sub.key` (and `-x.sub`) as a part of the JSON option `--flag`.
    """
    if not arg.startswith("-") or arg in ("-", "--") or re.match(r"^-[0-9.]", arg):
        return None
    head = arg.split("=", 1)[0]
    if head.startswith("--"):
        first = head[2:].split(".", 1)[0]
        return "--" + first.replace("_", "-")
    return head.split(".", 1)[0]


def managed_flag_of(arg: str) -> tuple[str, str] | None:
    """(managed option, its field) when `arg` sets a managed flag in any spelling vLLM accepts."""
    flag = engine_flag(arg)
    if flag is None:
        return None
    if flag in MANAGED_ENGINE_FLAGS:
        return flag, MANAGED_ENGINE_FLAGS[flag]
    # argparse's allow_abbrev is on in vLLM's parsers: an unambiguous prefix means the whole option.
    if flag not in _EXACT_OPTIONS_PREFIXING_MANAGED:
        for option, source in MANAGED_ENGINE_FLAGS.items():
            same_dashes = option.startswith("--") == flag.startswith("--")
            if same_dashes and len(flag) >= 2 and option.startswith(flag):
                return option, source
    return None


# Options whose value is a secret: extraArgs are kept in the last-good record (a ConfigMap) and the pod
# spec, both readable by far more people than a Secret. Each with its shortest spelling we treat as it
# (argparse accepts unambiguous prefixes; shorter ones are ambiguous in vLLM and refused by it).
SECRET_ENGINE_FLAGS = {
    "--hf-token": ("--hf-t", "model.hfTokenSecretRef (a Secret the engine reads as a file)"),
    "--api-key": ("--api-k", "engine.extraEnv VLLM_API_KEY with valueFrom.secretKeyRef"),
}


def secret_flag_of(arg: str) -> tuple[str, str] | None:
    """(option, where the secret belongs instead) when `arg` passes a secret on the command line."""
    flag = engine_flag(arg)
    if flag is None:
        return None
    for option, (shortest, instead) in SECRET_ENGINE_FLAGS.items():
        if flag.startswith(shortest) and option.startswith(flag):
            return option, instead
    return None


# Counted into the GPU request (a worker per GPU); data parallelism is refused (see EngineSpec).
PIPELINE_PARALLEL_OPTIONS = ("--pipeline-parallel-size", "-pp")
DEFAULT_GPUS_PER_NODE = 8


def _is_pipeline_parallel(flag: str) -> bool:
    if flag == "-pp":
        return True
    # argparse abbreviations: vLLM has no other option starting with --pipe.
    return flag.startswith("--pipe") and PIPELINE_PARALLEL_OPTIONS[0].startswith(flag)


def is_data_parallel(flag: str) -> bool:
    """-dp and every --data-parallel-* option (and their abbreviations, -dpl, -dpr, ...)."""
    if flag.startswith("-dp") and not flag.startswith("--"):
        return True
    return flag.startswith("--data-parallel") or (
        len(flag) > len("--dat") and "--data-parallel".startswith(flag)
    )


def pipeline_parallel_size(extra_args: Sequence[str]) -> int:
    size = 1
    for index, arg in enumerate(extra_args):
        flag = engine_flag(arg)
        if flag is None or not _is_pipeline_parallel(flag):
            continue
        if "=" in arg:
            value: str | None = arg.split("=", 1)[1]
        else:
            value = extra_args[index + 1] if index + 1 < len(extra_args) else None
        if value is None or not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise ValueError(
                f"engine.extraArgs: {flag} needs a positive whole number of pipeline stages, got {value!r}"
            )
        size = int(value)
    return size


# Environment that the operator sets itself.
MANAGED_ENV = {
    "PYTHONHASHSEED": "engine.pythonHashSeed",
    "MOONCAKE_CONFIG_PATH": "store",
    "HF_TOKEN": "model.hfTokenSecretRef",
    "HF_TOKEN_PATH": "model.hfTokenSecretRef",
    "HF_HOME": "model.cache",
    "MC_STORE_CLUSTER_ID": "store.master.highAvailability",
    "SSL_CERT_DIR": "store.master.highAvailability.etcd.external.tls",
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "the pod's IP (status.podIP), the store client's address",
    "XDG_CACHE_HOME": "the writable /tmp volume (the root filesystem may be read-only)",
    "TRITON_CACHE_DIR": "the writable /tmp volume (the root filesystem may be read-only)",
}
