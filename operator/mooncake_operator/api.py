"""The MooncakeServing API: pydantic models of spec and status, the single source of truth.

The CRD schema (`mooncake_operator.crd`), the renderer and the engine command line are all derived from
these models. Fields are snake_case in Python and camelCase on the wire; unknown fields are rejected so a
typo in a manifest is an error, not a silently ignored setting. Every cross-field rule lives in a model
validator here, so an invalid resource is rejected whole before anything is rendered or applied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

GROUP = "serving.mooncake-operator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MooncakeServing"
PLURAL = "mooncakeservings"
SINGULAR = "mooncakeserving"
SHORT_NAMES = ("mcs",)

GPU_RESOURCE = "nvidia.com/gpu"
# Children are named "<name>-store-config", "<name>-replica-<ordinal>" ...; a StatefulSet's pods carry a
# "controller-revision-hash" label of "<statefulset>-<10 chars>", which must fit in 63 characters.
MAX_NAME_LENGTH = 40


# --- sizes -------------------------------------------------------------------------------------------

# Mooncake store sizes use the grammar vLLM's MooncakeStoreConfig parses: a number and an optional unit
# GB/MB/KB/B, case-insensitive, binary multiples (1GB = 1024**3 bytes). We accept exactly that grammar, so
# every value we write into mooncake_store.json is one the engine reads the same way.
_STORE_SIZE_UNITS = {"gb": 1024**3, "mb": 1024**2, "kb": 1024, "b": 1, "": 1}
_STORE_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|mb|kb|b)?\s*$", re.IGNORECASE)


def parse_store_size(value: str) -> int:
    """Bytes of a Mooncake store size ("80GB", "4GB", "512MB"; binary units, as Mooncake reads them)."""
    match = _STORE_SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse size {value!r}: write a number and one of the units GB, MB, KB or B "
            '(binary, as Mooncake reads them: "80GB" is 80 * 1024**3 bytes), e.g. "80GB" or "512MB"'
        )
    number, unit = match.group(1), (match.group(2) or "").lower()
    return int(Decimal(number) * _STORE_SIZE_UNITS[unit])


def _check_store_size(value: str) -> str:
    parse_store_size(value)
    return value


# The pattern goes into the CRD only, so pydantic reports the friendlier message of `parse_store_size`.
STORE_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([gGmMkK]?[bB])?\s*$"
StoreSize = Annotated[
    str,
    AfterValidator(_check_store_size),
    Field(json_schema_extra={"pattern": STORE_SIZE_PATTERN}),
]

# Kubernetes resource quantities ("64Gi", "500m", "4"): resource.Quantity's grammar.
_QUANTITY_RE = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def parse_quantity(value: str | int) -> Decimal:
    """The numeric value of a Kubernetes quantity ("64Gi" -> 68719476736, "500m" -> 0.5)."""
    text = str(value).strip()
    match = _QUANTITY_RE.match(text)
    if match is None:
        raise ValueError(
            f"cannot parse quantity {value!r}: use a Kubernetes quantity such as '64Gi', '4' or '500m'"
        )
    number = Decimal(match.group("number"))
    suffix = match.group("suffix") or ""
    if suffix in _BINARY_SUFFIXES:
        return number * _BINARY_SUFFIXES[suffix]
    if suffix in _DECIMAL_SUFFIXES:
        return number * _DECIMAL_SUFFIXES[suffix]
    try:
        return number * Decimal(10) ** int(suffix[1:])
    except (InvalidOperation, ValueError) as error:  # pragma: no cover - the regex admits only integers
        raise ValueError(f"cannot parse quantity {value!r}") from error


def _check_quantity(value: str | int) -> str | int:
    if parse_quantity(value) < 0:
        raise ValueError(f"quantity {value!r} must not be negative")
    return value


Quantity = Annotated[str | int, AfterValidator(_check_quantity)]


# --- base ----------------------------------------------------------------------------------------------


class ApiModel(BaseModel):
    """Frozen, camelCase on the wire, unknown fields rejected, no type coercion (as the API server)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        populate_by_name=True,
        alias_generator=to_camel,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-compatible wire form (camelCase keys, unset optional fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- spec ----------------------------------------------------------------------------------------------


class SecretKeyRef(ApiModel):
    """A key in a Secret in the resource's namespace."""

    name: str = Field(min_length=1, description="Name of the Secret.")
    key: str = Field(default="token", min_length=1, description="Key within the Secret.")


class ModelCache(ApiModel):
    """Where the Hugging Face cache (model and draft weights) lives on each replica.

    Either an existing PersistentVolumeClaim (shared, ReadWriteMany, so weights download once) or an
    ephemeral emptyDir per pod (the default; weights download on every pod start).
    """

    existing_claim: str | None = Field(
        default=None,
        min_length=1,
        description="Name of an existing PersistentVolumeClaim mounted as the Hugging Face cache.",
    )
    ephemeral_size: Quantity | None = Field(
        default=None,
        description="Size limit of the per-pod emptyDir cache, e.g. '500Gi'. Only without existingClaim.",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ModelCache:
        if self.existing_claim is not None and self.ephemeral_size is not None:
            raise ValueError(
                "model.cache: set either existingClaim (a PersistentVolumeClaim) or ephemeralSize "
                "(a per-pod emptyDir), not both"
            )
        return self


class ModelSpec(ApiModel):
    name: str = Field(
        min_length=1,
        description="Hugging Face model id served by every replica, e.g. MiniMaxAI/MiniMax-M2.5.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description="Model revision (commit). Pin it: replicas must load identical weights.",
    )
    tokenizer_revision: str | None = Field(default=None, min_length=1, description="Tokenizer revision.")
    trust_remote_code: bool = Field(default=False, description="Pass --trust-remote-code.")
    max_model_len: int | None = Field(default=None, ge=1, description="Pass --max-model-len.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Hugging Face cache volume.")
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the Hugging Face token (exposed as HF_TOKEN). Never inline a token.",
    )


class EnvVar(ApiModel):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str


class ResourceRequirements(ApiModel):
    """Kubernetes resource requests and limits (quantities as strings or integers)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


# Engine flags that the operator derives from typed fields; setting them again through extraArgs would let
# replicas, store and canary disagree about what is running.
MANAGED_ENGINE_FLAGS = {
    "--model": "model.name",
    "--revision": "model.revision",
    "--tokenizer-revision": "model.tokenizerRevision",
    "--trust-remote-code": "model.trustRemoteCode",
    "--max-model-len": "model.maxModelLen",
    "--tensor-parallel-size": "engine.tensorParallelSize",
    "-tp": "engine.tensorParallelSize",
    "--block-size": "engine.blockSize",
    "--kv-transfer-config": "store",
    "--speculative-config": "speculative",
    "--host": "(managed by the operator)",
    "--port": "engine.port",
    "--served-model-name": "model.name",
}
# Environment that the operator sets itself.
MANAGED_ENV = {
    "PYTHONHASHSEED": "engine.pythonHashSeed",
    "MOONCAKE_CONFIG_PATH": "store",
    "HF_TOKEN": "model.hfTokenSecretRef",
    "HF_HOME": "model.cache",
}


class EngineSpec(ApiModel):
    image: str = Field(
        min_length=1,
        description="vLLM engine image carrying the MooncakeStore load_mask fix (images/vllm-mooncake).",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs per replica (--tensor-parallel-size)."
    )
    block_size: int = Field(default=16, ge=1, description="KV block size in tokens (--block-size).")
    python_hash_seed: int = Field(
        default=0,
        ge=0,
        le=4294967295,
        description="PYTHONHASHSEED; identical on every replica so block hashes (store keys) agree.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` arguments, appended.")
    extra_env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description=(
            "Resources of the engine container. nvidia.com/gpu is set from tensorParallelSize; in embedded "
            "mode the store's memory is added to the memory request/limit."
        ),
    )
    shared_memory_size: Quantity | None = Field(
        default=None, description="Size limit of the memory-backed /dev/shm (unlimited when unset)."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the OpenAI-compatible server.")
    startup_timeout_seconds: int = Field(
        default=3600,
        ge=10,
        description="How long a replica may take to download and load its weights before it is restarted.",
    )

    @model_validator(mode="after")
    def _no_managed_settings(self) -> EngineSpec:
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_ENGINE_FLAGS:
                raise ValueError(
                    f"engine.extraArgs must not contain {flag}: it is set from {MANAGED_ENGINE_FLAGS[flag]}"
                )
        for env in self.extra_env:
            if env.name in MANAGED_ENV:
                raise ValueError(
                    f"engine.extraEnv must not set {env.name}: it is set from {MANAGED_ENV[env.name]}"
                )
        for section in (self.resources.requests, self.resources.limits):
            if GPU_RESOURCE in section:
                raise ValueError(
                    f"engine.resources must not set {GPU_RESOURCE}: it is set from engine.tensorParallelSize"
                )
        return self


class SpeculativeSpec(ApiModel):
    method: Literal["eagle3"] = Field(default="eagle3", description="Speculative decoding method.")
    model: str | None = Field(default=None, min_length=1, description="Draft model id.")
    revision: str | None = Field(default=None, min_length=1, description="Draft model revision (commit).")
    num_speculative_tokens: int = Field(default=3, ge=1)
    draft_tensor_parallel_size: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _draft_pinned(self) -> SpeculativeSpec:
        missing = [name for name, value in (("model", self.model), ("revision", self.revision)) if not value]
        if missing:
            raise ValueError(
                f"speculative.method {self.method} needs a draft model pinned to a revision; missing: "
                + ", ".join(f"speculative.{name}" for name in missing)
            )
        return self


class MasterSpec(ApiModel):
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Image with mooncake_master; default engine.image (it carries mooncake-transfer-engine).",
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    rpc_port: int = Field(default=50051, ge=1, le=65535)
    metrics_port: int = Field(default=9003, ge=1, le=65535)

    @model_validator(mode="after")
    def _distinct_ports(self) -> MasterSpec:
        if self.rpc_port == self.metrics_port:
            raise ValueError(f"store.master: rpcPort and metricsPort must differ (both {self.rpc_port})")
        return self


class StoreSpec(ApiModel):
    mode: Literal["embedded"] = Field(
        default="embedded", description="embedded: every tensor-parallel worker contributes a segment."
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field(default="", description="RDMA device(s), e.g. 'mlx5_0'; required for rdma.")
    global_segment_size: StoreSize | None = Field(
        default=None,
        description="Memory each tensor-parallel worker contributes to the shared pool, e.g. '80GB'.",
    )
    local_buffer_size: StoreSize = Field(default="4GB", description="Per-worker transfer buffer, e.g. '4GB'.")
    enable_offload: bool = False
    load_async: bool = Field(default=True, description="kv_connector_extra_config.load_async.")
    metadata_server: Literal["P2PHANDSHAKE"] = "P2PHANDSHAKE"
    master: MasterSpec = Field(default_factory=MasterSpec)

    @model_validator(mode="after")
    def _consistent(self) -> StoreSpec:
        if self.mode == "embedded" and (
            self.global_segment_size is None or parse_store_size(self.global_segment_size) == 0
        ):
            raise ValueError(
                "store.mode embedded needs store.globalSegmentSize > 0 (the memory each tensor-parallel "
                'worker contributes to the shared pool), e.g. "80GB"'
            )
        if parse_store_size(self.local_buffer_size) == 0:
            raise ValueError('store.localBufferSize must be greater than zero, e.g. "4GB"')
        if self.protocol == "rdma" and not self.device_name.strip():
            raise ValueError("store.protocol rdma needs store.deviceName (the RDMA device, e.g. mlx5_0)")
        return self

    def segment_bytes(self) -> int:
        return parse_store_size(self.global_segment_size) if self.global_segment_size else 0

    def local_buffer_bytes(self) -> int:
        return parse_store_size(self.local_buffer_size)


class ExpectationSpec(BaseModel):
    """One content check, e.g. {kind: json_values_include, values: [us-west, 4, 16]}."""

    # The other fields depend on `kind`; the canary (mooncake_operator.canary) validates them when the
    # operator builds a run, which keeps this API free of the canary's types.

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    kind: str = Field(min_length=1, description="The check, e.g. json_object_only, json_values_include.")


class CanarySpec(ApiModel):
    enabled: bool = True
    request: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Chat-completions request body sent to writer and reader. Unset: the customer's request "
            "(mooncake_operator.canary.customer_request())."
        ),
    )
    expectations: list[ExpectationSpec] | None = Field(
        default=None,
        description=(
            "Checks every answer must pass, as in `mooncake-operator canary --expect`. Unset: the "
            "customer's (one JSON object with the latest values, nothing before it); []: content checks off."
        ),
    )
    pairs: Literal["ring", "first"] = Field(
        default="ring", description="ring: every replica proven as writer and reader; first: replica 0 -> 1."
    )
    require_external_hit: bool = Field(
        default=True,
        description="Without a rise of the reader's external-hit counter the run is Inconclusive.",
    )
    timeout_seconds: int = Field(default=300, ge=1, description="Timeout of one canary request.")
    interval_seconds: int | None = Field(
        default=None, ge=1, description="Re-run the canary this often; unset: only on rollouts and restarts."
    )
    on_failure: Literal["Hold", "Rollback"] = Field(
        default="Hold",
        description=(
            "Hold: keep the pods, take them out of the client Service. "
            "Rollback: restore the last good revision."
        ),
    )


class MooncakeServingSpec(ApiModel):
    model: ModelSpec
    engine: EngineSpec
    speculative: SpeculativeSpec | None = Field(default=None, description="Speculative decoding (Eagle-3).")
    replicas: int = Field(default=2, ge=1, description="Number of vLLM replicas sharing the store.")
    store: StoreSpec
    canary: CanarySpec = Field(default_factory=CanarySpec)

    @model_validator(mode="after")
    def _canary_needs_pairs(self) -> MooncakeServingSpec:
        if self.canary.enabled and self.replicas < 2:
            raise ValueError(
                f"replicas is {self.replicas} but the canary needs at least 2 replicas (a writer and a "
                "reader); set replicas >= 2 or canary.enabled: false"
            )
        return self


# --- status --------------------------------------------------------------------------------------------

Phase = Literal["Pending", "Deploying", "Canary", "Ready", "CanaryFailed", "Degraded", "Invalid"]
ConditionType = Literal["MasterReady", "ReplicasReady", "CanaryPassed", "Ready"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("MasterReady", "ReplicasReady", "CanaryPassed", "Ready")
Verdict = Literal["Passed", "Failed", "Inconclusive"]


class Condition(ApiModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339 time of the last status change.")
    observed_generation: int | None = Field(default=None, ge=0)


class ReplicaCounts(ApiModel):
    desired: int = Field(ge=0)
    ready: int = Field(ge=0)


class Mismatch(ApiModel):
    position: int = Field(ge=0, description="Index of the first differing character.")
    cold: str = Field(description="Cold (writer) text around the mismatch.")
    warm: str = Field(description="Warm (reader) text around the mismatch.")


class PairEvidence(ApiModel):
    writer: str
    reader: str
    verdict: Verdict
    reason: str = ""
    cache_salt: str | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)
    external_hit_tokens: int | None = Field(default=None, ge=0, description="Rise of the reader's counter.")
    expected_external_hit_tokens: int | None = Field(default=None, ge=0)
    load_get_keys: int | None = Field(default=None, ge=0, description="Store keys the reader loaded.")
    answers_equal: bool | None = None
    cold_latency_ms: float | None = Field(default=None, ge=0)
    warm_latency_ms: float | None = Field(default=None, ge=0)
    first_mismatch: Mismatch | None = None
    violations: list[str] = Field(default_factory=list, description="Expectations violated, one per entry.")
    notes: list[str] = Field(default_factory=list, description="Evidence that did not decide the verdict.")


class CanaryTarget(ApiModel):
    """What a canary run was run against; a difference from the present state makes the next run due."""

    revision: str = Field(description="Digest of the spec the replicas were rendered from.")
    generation: int | None = Field(default=None, ge=0)
    replica_pods: list[str] = Field(default_factory=list, description="name=uid of each replica pod.")
    master_pod: str | None = Field(default=None, description="UID of the master pod.")
    master_restarts: int = Field(default=0, ge=0, description="Container restarts of the master pod.")
    rerun: str | None = Field(default=None, description="Value of the rerun-canary annotation.")


class CanaryStatus(ApiModel):
    run_id: str
    verdict: Verdict
    reason: str = ""
    external_hit_tokens: int | None = Field(default=None, ge=0, description="Sum over pairs.")
    started_at: str | None = None
    finished_at: str | None = None
    pairs: list[PairEvidence] = Field(default_factory=list)
    target: CanaryTarget | None = None


class PodTraffic(ApiModel):
    """One replica pod's place in user traffic, and why."""

    name: str
    uid: str
    revision: str | None = Field(
        default=None, description="The pod's controller-revision-hash: the pod template it runs."
    )
    serving: bool = Field(description="Whether the client Service routes users to it (label traffic=on).")
    reason: str = ""
    proven_by: str | None = Field(
        default=None, description="Run id of the canary that proved this pod at its revision."
    )


class TrafficStatus(ApiModel):
    serving: int = Field(default=0, ge=0, description="Replica pods in the client Service.")
    pods: list[PodTraffic] = Field(default_factory=list)


class MooncakeServingStatus(ApiModel):
    phase: Phase | None = None
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list)
    replicas: ReplicaCounts | None = None
    canary: CanaryStatus | None = None
    last_good_revision: str | None = None
    desired_revision: str | None = Field(default=None, description="Digest of the spec.")
    serving_revision: str | None = Field(default=None, description="Digest of the spec the children run.")
    failed_revision: str | None = Field(
        default=None, description="Spec revision rolled back after a failure."
    )
    out_of_traffic: list[str] = Field(
        default_factory=list, description="Replica pods held out of the client Service by a failed canary."
    )
    traffic: TrafficStatus | None = Field(
        default=None, description="Which replica pods serve users, and why (off until a canary proves them)."
    )


# --- resource ------------------------------------------------------------------------------------------


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads; everything the API server adds is ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True, alias_generator=to_camel)

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="Lower-case letters, digits and '-', starting with a letter (children are Services).",
    )
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class MooncakeServing(ApiModel):
    api_version: Literal["serving.mooncake-operator.dev/v1alpha1"] = "serving.mooncake-operator.dev/v1alpha1"
    kind: Literal["MooncakeServing"] = "MooncakeServing"
    metadata: ObjectMeta
    spec: MooncakeServingSpec
    status: MooncakeServingStatus | None = None


class InvalidResourceError(ValueError):
    """A MooncakeServing that can never be valid; `problems` lists every reason, one per entry."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid MooncakeServing:\n" + "\n".join(f"  - {p}" for p in problems))


def describe_validation_error(error: ValidationError, prefix: str = "") -> list[str]:
    """One readable line per problem: the wire path (camelCase) and the message."""
    problems = []
    for item in error.errors():
        path = ".".join([prefix, *(str(part) for part in item["loc"])] if prefix else map(str, item["loc"]))
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{path}: {message}" if path else message)
    return problems


def plain(obj: Any) -> Any:
    """Mappings and sequences (e.g. kopf's read-only views of a body) as plain dicts and lists, which the
    strict models require."""
    if isinstance(obj, Mapping):
        return {key: plain(value) for key, value in obj.items()}
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [plain(value) for value in obj]
    return obj


def parse_resource(obj: Any) -> MooncakeServing:
    """Validate a whole MooncakeServing (as read from YAML or the API); raises InvalidResourceError."""
    try:
        return MooncakeServing.model_validate(plain(obj))
    except ValidationError as error:
        raise InvalidResourceError(describe_validation_error(error)) from error


def parse_spec(spec: Any) -> MooncakeServingSpec:
    """Validate a spec alone (as handed to an operator handler); raises InvalidResourceError."""
    try:
        return MooncakeServingSpec.model_validate(plain(spec))
    except ValidationError as error:
        raise InvalidResourceError(describe_validation_error(error, prefix="spec")) from error
