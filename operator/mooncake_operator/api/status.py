"""MooncakeServingStatus: phase, conditions, the canary's evidence, traffic, rollout and the
masters' leader, as the operator writes them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Strict

from mooncake_operator.api.base import ApiModel
from mooncake_operator.api.spec import RolloutStrategy
from mooncake_operator.canary.models import Mismatch, PutWaitOutcome, Verdict

# Foreign pods in the client Service named in status.foreignPods and events: the first this many found.
MAX_FOREIGN_PODS = 8


# The canary's Verdict, read back from the API as the string it was written as.
VerdictField = Annotated[Verdict, Strict(False)]
PutWaitOutcomeField = Annotated[PutWaitOutcome, Strict(False)]

# CanaryInconclusive is its own phase: the operator retries it by itself, so it must never read as a
# failure (CanaryFailed, Stalled) to Argo CD, Flux or a person.
Phase = Literal[
    "Pending", "Deploying", "Canary", "Ready", "CanaryFailed", "CanaryInconclusive", "Degraded", "Invalid"
]
ConditionType = Literal["MasterReady", "ReplicasReady", "CanaryPassed", "Ready", "Reconciling", "Stalled"]
# What each reconcile decides; then kstatus' two, derived from Ready (conditions.kstatus_states).
CONDITION_TYPES: tuple[ConditionType, ...] = ("MasterReady", "ReplicasReady", "CanaryPassed", "Ready")
KSTATUS_CONDITION_TYPES: tuple[ConditionType, ...] = ("Reconciling", "Stalled")


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


class DivergenceEvidence(ApiModel):
    """The first token where the warm answer left the cold one, and the margins that judged it."""

    position: int = Field(ge=0, description="Index of the first differing token.")
    kind: Literal["benign", "corruption", "unjudged"]
    cold_token: str | None = None
    warm_token: str | None = None
    cold_gap_nats: float | None = Field(
        default=None, description="In the cold distribution: |logprob(cold token) - logprob(warm token)|."
    )
    warm_gap_nats: float | None = Field(
        default=None, description="In the warm distribution: |logprob(warm token) - logprob(cold token)|."
    )
    max_drift_nats: float | None = Field(
        default=None, description="Largest cold-versus-warm change of a shared token's logprob before it."
    )
    shared_tokens: int = Field(default=0, ge=0)
    reasons: list[str] = Field(default_factory=list, description="Why it is not benign.")


class PairEvidence(ApiModel):
    writer: str
    reader: str
    verdict: VerdictField
    reason: str = ""
    cache_salt: str | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)
    external_hit_tokens: int | None = Field(default=None, ge=0, description="Rise of the reader's counter.")
    expected_external_hit_tokens: int | None = Field(default=None, ge=0)
    load_get_keys: int | None = Field(default=None, ge=0, description="Store keys the reader loaded.")
    # The pair's own evidence (each answer's, not the replica's counters): what proves a reader that
    # serves users while it is re-proven.
    warm_cached_tokens: int | None = Field(
        default=None,
        ge=0,
        description="The warm answer's usage.prompt_tokens_details.cached_tokens (unset: not reported).",
    )
    cold_cached_tokens: int | None = Field(
        default=None, ge=0, description="The cold answer's cached_tokens; 0 for a cold reference."
    )
    warm_draft_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Draft tokens of the warm answer's metrics.speculative_decoding (unset: not reported).",
    )
    hit_evidence: Literal["answer", "counters"] | None = Field(
        default=None,
        description=(
            "What proved the reader's load: answer (its own cached_tokens) or counters (a rise attributable "
            "to the warm request alone); unset: not proven."
        ),
    )
    put_wait: PutWaitOutcomeField | None = Field(
        default=None,
        description=(
            "The wait for the writer's store puts before the warm request: covered, timeout, failed, "
            "no_store_metrics, unavailable or off (spec.canary.putWaitSeconds 0)."
        ),
    )
    put_wait_ms: float | None = Field(default=None, ge=0, description="How long that wait took.")
    answers_equal: bool | None = None
    cold_latency_ms: float | None = Field(default=None, ge=0)
    warm_latency_ms: float | None = Field(default=None, ge=0)
    first_mismatch: Mismatch | None = None
    request: str | None = Field(default=None, description="Which of the run's requests the pair ran.")
    divergence: DivergenceEvidence | None = Field(
        default=None, description="The first differing token, judged: benign (passed) or not."
    )
    violations: list[str] = Field(default_factory=list, description="Expectations violated, one per entry.")
    notes: list[str] = Field(default_factory=list, description="Evidence that did not decide the verdict.")


class CanaryTarget(ApiModel):
    """What a canary run was run against; a difference from the present state makes the next run due."""

    revision: str = Field(
        description="Spec revision: the digest of the spec the replicas were rendered from."
    )
    generation: int | None = Field(default=None, ge=0)
    replica_pods: list[str] = Field(
        default_factory=list,
        description="name=uid of each replica pod, then #N once its containers restarted N times.",
    )
    master_pod: str | None = Field(default=None, description="UID of the master pod.")
    master_restarts: int = Field(default=0, ge=0, description="Container restarts of the master pod.")
    rerun: str | None = Field(default=None, description="Value of the rerun-canary annotation.")
    master_leader: str | None = Field(
        default=None, description="Highly available masters: the pod that led (Mooncake's own view)."
    )


class CanaryStatus(ApiModel):
    run_id: str
    verdict: VerdictField
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
        default=None,
        description="Pod template hash: the pod's controller-revision-hash, the pod template it runs.",
    )
    serving: bool = Field(description="Whether the client Service routes users to it (label traffic=on).")
    reason: str = ""
    proven_by: str | None = Field(
        default=None, description="Run id of the canary that proved this pod at its pod template."
    )
    restarts: int | None = Field(
        default=None,
        ge=0,
        description="The pod's container restart count when this entry was written: a higher count (the "
        "engine restarted in place) takes the pod out of traffic until a canary proves the new process.",
    )


class TrafficStatus(ApiModel):
    serving: int = Field(default=0, ge=0, description="Replica pods in the client Service.")
    pods: list[PodTraffic] = Field(default_factory=list)


CandidatePhase = Literal["Deploying", "Canary", "Inconclusive", "Held"]


class RolloutStatus(ApiModel):
    """Which replica set serves users and, during a BlueGreen rollout, the candidate set and its phase."""

    strategy: RolloutStrategy
    serving_set: str | None = Field(
        default=None, description="The replica StatefulSet whose proven pods serve users."
    )
    candidate_set: str | None = Field(
        default=None, description="BlueGreen: the new revision's StatefulSet, not serving until it passes."
    )
    candidate_phase: CandidatePhase | None = Field(
        default=None,
        description=(
            "Deploying, Canary (being proven), Inconclusive (retried; never switched to), Held (failed, "
            "kept for inspection by onFailure Hold; never switched to)."
        ),
    )
    message: str = ""


class HighAvailabilityStatus(ApiModel):
    """Which master leads, as the masters themselves report it (/health), and how often it changed."""

    leader: str | None = Field(default=None, description="Pod of the leading master; unset while none leads.")
    leader_address: str | None = Field(default=None, description="The address the leader publishes.")
    view_version: int | None = Field(default=None, ge=0, description="Mooncake's master-view version.")
    failovers: int = Field(default=0, ge=0, description="Leader changes the operator observed.")
    last_failover_time: str | None = Field(default=None, description="RFC 3339 time of the last one.")


class MooncakeServingStatus(ApiModel):
    phase: Phase | None = None
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(default_factory=list)
    replicas: ReplicaCounts | None = None
    selector: str | None = Field(
        default=None,
        description="The replica pods' label selector, for the scale subresource (HPA, KEDA).",
    )
    canary: CanaryStatus | None = None
    last_good_revision: str | None = Field(
        default=None, description="Spec revision the last passing canary proved (what Rollback restores)."
    )
    desired_revision: str | None = Field(default=None, description="Spec revision: the digest of the spec.")
    serving_revision: str | None = Field(
        default=None, description="Spec revision the children are rendered from."
    )
    failed_revision: str | None = Field(
        default=None, description="Spec revision rolled back after a failure."
    )
    out_of_traffic: list[str] = Field(
        default_factory=list, description="Replica pods held out of the client Service by a failed canary."
    )
    traffic: TrafficStatus | None = Field(
        default=None, description="Which replica pods serve users, and why (off until a canary proves them)."
    )
    high_availability: HighAvailabilityStatus | None = Field(
        default=None, description="The masters' leader (store.master.highAvailability only)."
    )
    rollout: RolloutStatus | None = Field(
        default=None, description="The serving replica set and, with BlueGreen, the candidate set."
    )
    foreign_pods: list[str] | None = Field(
        default=None,
        max_length=MAX_FOREIGN_PODS,
        description=(
            "Pods the client Service selects (they carry every label of its selector) that no replica "
            "StatefulSet of this resource created: they get user traffic no canary proved. Unset when "
            f"none; at most {MAX_FOREIGN_PODS} named."
        ),
    )
