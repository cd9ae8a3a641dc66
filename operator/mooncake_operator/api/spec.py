"""MooncakeServingSpec and the parts that are not a room of their own: the model, the engine,
speculative decoding, network policy and rollout. Every cross-field rule lives in a model validator,
so an invalid resource is rejected whole before anything is built or applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from mooncake_operator.api.base import ApiModel
from mooncake_operator.api.canary_spec import CanarySpec
from mooncake_operator.api.engine_flags import (
    DEFAULT_GPUS_PER_NODE,
    MANAGED_ENV,
    engine_flag,
    is_data_parallel,
    managed_flag_of,
    pipeline_parallel_size,
    secret_flag_of,
)
from mooncake_operator.api.images import ImageReference
from mooncake_operator.api.kube_types import (
    GPU_RESOURCE,
    ContainerSecurityContext,
    EgressRule,
    EnvVar,
    LocalObjectReference,
    NetworkPolicyPeer,
    ResourceRequirements,
)
from mooncake_operator.api.quantities import Quantity, parse_quantity
from mooncake_operator.api.replica_pod import PodMetadata, ReplicaPodSpec, ReplicaScheduling
from mooncake_operator.api.store import StoreSpec

# Replicas of one model sharing one store. 64 replicas of a TP-8 model are 512 GPUs behind one Mooncake
# master; the canary proves them as a ring, one pair at a time (2 chat requests each), so a full run stays
# in minutes, and the operator's per-replica Services and reads stay small. Beyond that, shard into
# several MooncakeServings (each its own store); raise it here, with a measurement, if a user needs more.
MAX_REPLICAS = 64


class CacheClaimTemplate(ApiModel):
    """One PersistentVolumeClaim per replica (the StatefulSet's volumeClaimTemplates), ReadWriteOnce."""

    size: Quantity = Field(description="Requested storage, e.g. '600Gi'.")
    storage_class_name: str | None = Field(
        default=None, min_length=1, description="StorageClass; unset: the cluster's default class."
    )

    @model_validator(mode="after")
    def _positive(self) -> CacheClaimTemplate:
        if parse_quantity(self.size) <= 0:
            raise ValueError("model.cache.volumeClaimTemplate.size must be greater than zero, e.g. '600Gi'")
        return self


class EgressSpec(ApiModel):
    """Where the replicas may connect (set: nowhere else)."""

    dns: list[NetworkPolicyPeer] | None = Field(
        default=None,
        min_length=1,
        description=(
            "The cluster's DNS servers (port 53, UDP and TCP). Unset: pods labelled k8s-app=kube-dns in "
            "namespace kube-system."
        ),
    )
    to: list[EgressRule] = Field(
        default_factory=list,
        description=(
            "More destinations: a model hub or mirror, an external etcd, a tracing collector. The store's "
            "peers (this resource's replicas), its masters and a managed etcd are always allowed."
        ),
    )


class NetworkPolicySpec(ApiModel):
    enabled: bool = Field(default=True, description="Render the NetworkPolicies of master and replicas.")
    operator: NetworkPolicyPeer | None = Field(
        default=None,
        description=(
            "Who the operator is (it runs the canary against the replicas' HTTP port). Unset: pods "
            "labelled app.kubernetes.io/name=mooncake-operator in the operator's own namespace."
        ),
    )
    clients: list[NetworkPolicyPeer] | None = Field(
        default=None,
        description=(
            "Who may call the replicas' HTTP port, besides the operator. Unset: anyone, or only the "
            "operator where it runs with --replica-ingress-default=listed-clients."
        ),
    )
    egress: EgressSpec | None = Field(
        default=None,
        description=(
            "Restrict the replicas' egress to DNS, the store (replicas, masters, managed etcd) and "
            "egress.to. Unset: egress is not restricted."
        ),
    )


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
        description=(
            "Size limit of the per-pod emptyDir cache, e.g. '500Gi', also requested as ephemeral-storage. "
            "Only without existingClaim."
        ),
    )
    volume_claim_template: CacheClaimTemplate | None = Field(
        default=None,
        description="A ReadWriteOnce PersistentVolumeClaim per replica (recommended for production).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ModelCache:
        chosen = [
            name
            for name, value in (
                ("existingClaim", self.existing_claim),
                ("ephemeralSize", self.ephemeral_size),
                ("volumeClaimTemplate", self.volume_claim_template),
            )
            if value is not None
        ]
        if len(chosen) > 1:
            raise ValueError(
                "model.cache: set either existingClaim (a PersistentVolumeClaim) or ephemeralSize "
                "(a per-pod emptyDir) or volumeClaimTemplate (a claim per replica), not both: "
                + " and ".join(chosen)
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
        description="Hugging Face revision of the weights. Pin a commit: replicas must load equal weights.",
    )
    tokenizer_revision: str | None = Field(
        default=None, min_length=1, description="Hugging Face revision of the tokenizer."
    )
    trust_remote_code: bool = Field(default=False, description="Pass --trust-remote-code.")
    max_model_len: int | None = Field(default=None, ge=1, description="Pass --max-model-len.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Hugging Face cache volume.")
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret key holding the Hugging Face token, mounted as a file the engine reads through "
            "HF_TOKEN_PATH. Never inline a token."
        ),
    )
    served_model_name_aliases: list[str] = Field(
        default_factory=list,
        description=(
            "More names the replicas answer to (--served-model-name NAME ALIAS...). model.name stays the "
            "first served name: the canary and /v1/models use it."
        ),
    )

    @model_validator(mode="after")
    def _aliases_distinct(self) -> ModelSpec:
        seen = {self.name}
        for alias in self.served_model_name_aliases:
            if not alias.strip() or alias != alias.strip():
                raise ValueError(
                    f"model.servedModelNameAliases: {alias!r} must be a non-empty name without surrounding "
                    "spaces"
                )
            if alias in seen:
                raise ValueError(
                    f"model.servedModelNameAliases: {alias!r} is listed twice (model.name is always served)"
                )
            seen.add(alias)
        return self


class EngineSpec(ApiModel):
    image: ImageReference = Field(
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
    gpus_per_node: int = Field(
        default=DEFAULT_GPUS_PER_NODE,
        ge=1,
        le=64,
        description=(
            "GPUs the largest node offers. A replica runs on one node: tensorParallelSize times a "
            "--pipeline-parallel-size in extraArgs must fit."
        ),
    )
    security_context: ContainerSecurityContext | None = Field(
        default=None,
        description=(
            "The engine container's securityContext; each field set here replaces the operator's default "
            "(allowPrivilegeEscalation: false, capabilities.drop [ALL]). store.rdma adds what RDMA needs."
        ),
    )

    def pipeline_parallel_size(self) -> int:
        """The --pipeline-parallel-size (-pp) in extraArgs (argparse keeps the last), 1 without one."""
        return pipeline_parallel_size(self.extra_args)

    def gpus_per_replica(self) -> int:
        """GPUs one replica uses: one per worker, tensor-parallel times pipeline-parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size()

    @model_validator(mode="after")
    def _parallelism_fits_a_node(self) -> EngineSpec:
        for arg in self.extra_args:
            flag = engine_flag(arg)
            if flag is not None and is_data_parallel(flag):
                raise ValueError(
                    f"engine.extraArgs must not contain {arg.split('=', 1)[0]}: a replica is one "
                    "data-parallel rank; scale data parallelism with spec.replicas (each replica is proven "
                    "by the canary and counted in its GPU request)"
                )
        gpus = self.tensor_parallel_size * pipeline_parallel_size(self.extra_args)
        if gpus > self.gpus_per_node:
            raise ValueError(
                f"engine.tensorParallelSize ({self.tensor_parallel_size}) times the pipeline-parallel size "
                f"in engine.extraArgs ({gpus // self.tensor_parallel_size}) is {gpus} GPUs, more than "
                f"engine.gpusPerNode ({self.gpus_per_node}): a replica runs on one node"
            )
        return self

    @model_validator(mode="after")
    def _no_managed_settings(self) -> EngineSpec:
        for arg in self.extra_args:
            managed = managed_flag_of(arg)
            if managed is not None:
                option, source = managed
                spelled = "" if engine_flag(arg) == option else f" (vLLM reads {arg!r} as {option})"
                raise ValueError(
                    f"engine.extraArgs must not contain {option}{spelled}: it is set from {source}"
                )
            secret = secret_flag_of(arg)
            if secret is not None:
                option, instead = secret
                raise ValueError(
                    f"engine.extraArgs must not contain {option}: a secret on the command line lands in the "
                    f"pod spec and the operator's last-good record; use {instead}"
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
    revision: str | None = Field(
        default=None, min_length=1, description="Hugging Face revision of the draft (a commit)."
    )
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


class EndpointPickerRef(ApiModel):
    """The endpoint picker (the Gateway API Inference Extension's EPP) the InferencePool names."""

    name: str = Field(
        min_length=1, max_length=253, description="Name of the endpoint picker (a Service, by default)."
    )
    port: int = Field(
        ge=1,
        le=65535,
        description="Port of the endpoint picker's Service (the service port, not the target).",
    )
    kind: str = Field(
        default="Service",
        min_length=1,
        max_length=63,
        pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
        description="Kind of the referent.",
    )
    group: str = Field(
        default="",
        max_length=253,
        pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description='API group of the referent ("": the core group).',
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose",
        description=(
            "What the gateway does when the endpoint picker does not answer. FailClose (default) drops the "
            "request; FailOpen lets the gateway pick an endpoint of the pool itself (still a proven pod: the "
            "pool's selector admits no other)."
        ),
    )


class InferencePoolSpec(ApiModel):
    """An `inference.networking.k8s.io/v1` InferencePool for the Gateway API Inference Extension."""

    endpoint_picker: EndpointPickerRef = Field(
        description="The endpoint picker that routes the pool's requests (you deploy it)."
    )


RolloutStrategy = Literal["InPlace", "BlueGreen"]


class RolloutSpec(ApiModel):
    strategy: RolloutStrategy = Field(
        default="InPlace",
        description=(
            "How a change of the replica pod template reaches users. InPlace (default): the replica "
            "StatefulSet rolls one pod after another and a new pod joins the client Service only once a "
            "canary proved it; it needs no GPUs beyond spec.replicas, which is why it is the default. "
            "BlueGreen: a second replica set of the new revision comes up beside the serving one, the "
            "canary proves it alone, and only then the client Service switches to it and the old set is "
            "removed (a failed canary never switches: onFailure Hold keeps the new set for inspection, "
            "Rollback removes it). It costs twice the replicas' GPUs during a rollout."
        ),
    )
    max_unavailable: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description=(
            "InPlace: how many proven replicas a rollout may take out of the client Service at a time; at "
            "least replicas - maxUnavailable proven replicas keep serving throughout (with 2 replicas and "
            "the default 1, one keeps serving)."
        ),
    )
    max_surge: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description=(
            "InPlace: how many replicas beyond spec.replicas a rollout may add (each needs its GPUs), so "
            "that the first new replicas have a partner of their own pod template for the canary; removed "
            "once every replica runs the new template and is proven. maxSurge + maxUnavailable must be at "
            "least 2 when the canary is on."
        ),
    )
    paused: bool = Field(
        default=False,
        description=(
            "Hold any rollout: no replica pod is created, replaced or removed for a new pod template, and "
            "status.rollout.message says what waits; setting it back to false goes on from there."
        ),
    )


class MooncakeServingSpec(ApiModel):
    model: ModelSpec
    engine: EngineSpec
    speculative: SpeculativeSpec | None = Field(default=None, description="Speculative decoding (Eagle-3).")
    replicas: int = Field(
        default=2, ge=1, le=MAX_REPLICAS, description="Number of vLLM replicas sharing the store."
    )
    store: StoreSpec
    canary: CanarySpec = Field(default_factory=CanarySpec)
    scheduling: ReplicaScheduling | None = Field(default=None, description="Where replica pods run.")
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, description="Secrets for pulling the engine and master images."
    )
    pod_metadata: PodMetadata | None = Field(
        default=None, description="Extra labels and annotations of replica and master pods."
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="NetworkPolicies of master and replicas."
    )
    pod: ReplicaPodSpec = Field(
        default_factory=ReplicaPodSpec,
        description="Replica pods: securityContext, ServiceAccount, drain budget, extra volumes, containers.",
    )
    rollout: RolloutSpec | None = Field(
        default=None, description="Rollout strategy of the replicas; unset: strategy InPlace."
    )
    inference_pool: InferencePoolSpec | None = Field(
        default=None,
        description=(
            "Opt-in: an InferencePool (inference.networking.k8s.io/v1) named like the resource, whose "
            "selector admits only replica pods a canary proved (the client Service's selector). Needs the "
            "InferencePool CRD in the cluster."
        ),
    )

    @property
    def rollout_strategy(self) -> RolloutStrategy:
        return self.rollout.strategy if self.rollout is not None else "InPlace"

    @property
    def rollout_settings(self) -> RolloutSpec:
        return self.rollout if self.rollout is not None else RolloutSpec()

    @model_validator(mode="after")
    def _host_network_one_per_node(self) -> MooncakeServingSpec:
        rdma = self.store.rdma
        scheduling = self.scheduling
        if (
            rdma is not None
            and rdma.host_network
            and scheduling is not None
            and scheduling.replica_anti_affinity in ("Preferred", "None")
        ):
            raise ValueError(
                "scheduling.replicaAntiAffinity must be Required (or unset) with store.rdma.hostNetwork: "
                "two replicas on one node would bind the same host ports"
            )
        return self

    @model_validator(mode="after")
    def _pod_additions_fit_the_engine(self) -> MooncakeServingSpec:
        for container in self.pod.sidecars:
            for port in container.get("ports") or []:
                if isinstance(port, Mapping) and port.get("containerPort") == self.engine.port:
                    raise ValueError(
                        f"pod.sidecars {container['name']}: port {self.engine.port} is engine.port (the "
                        "containers of a pod share its network)"
                    )
        rdma = self.store.rdma
        context = self.engine.security_context
        host_devices = rdma is not None and rdma.host_devices
        if host_devices and context is not None and context.allow_privilege_escalation is False:
            raise ValueError(
                "engine.securityContext.allowPrivilegeEscalation: false contradicts "
                "store.rdma.hostDevices, which runs the engine privileged; use store.rdma.resourceName"
            )
        return self

    @model_validator(mode="after")
    def _canary_needs_pairs(self) -> MooncakeServingSpec:
        if self.canary.enabled and self.replicas < 2:
            raise ValueError(
                f"replicas is {self.replicas} but the canary needs at least 2 replicas (a writer and a "
                "reader); set replicas >= 2 or canary.enabled: false"
            )
        return self

    @model_validator(mode="after")
    def _first_new_replicas_pair(self) -> MooncakeServingSpec:
        rollout = self.rollout_settings
        if not self.canary.enabled or rollout.strategy != "InPlace":
            return self
        if rollout.max_surge + min(rollout.max_unavailable, self.replicas) < 2:
            raise ValueError(
                f"rollout.maxSurge ({rollout.max_surge}) + rollout.maxUnavailable "
                f"({rollout.max_unavailable}) is below 2: an InPlace rollout could never bring up two "
                "replicas of the new pod template for the canary to pair; raise maxSurge (extra GPUs "
                "during a rollout) or maxUnavailable (fewer replicas serving during it)"
            )
        return self
