"""The reader's evidence: vLLM's Prometheus counters, and the hit the prompt should give.

Names and labels as vLLM 0.32 registers them (`vllm/v1/metrics/loggers.py` and
`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/metrics.py`); Prometheus' client appends
`_total` to counters. Every counter carries `model_name` and `engine` labels (one label set per
engine core); the Mooncake ones add `operation` (`lookup_exists`, `save_exists`, `save_put`,
`load_get`) and `status` (`ok`, `partial_failure`, `error`). A page can carry several models (one
server, several engines): only the series of the model the request named count (`select_model`);
within it we sum over label sets (engines, statuses).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from mooncake_operator.canary.models import StoreCounters

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
STORE_OPERATION_KEYS = "vllm:mooncake_store_operation_keys_total"
STORE_FAILED_KEYS = "vllm:mooncake_store_operation_failed_keys_total"
# Speculative decoding (vllm/v1/spec_decode/metrics.py): rise only when the drafter ran.
SPEC_DECODE_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
# What the replica served: attributes a counter rise to the canary's own request when its answer carries
# no evidence of its own (vllm/v1/metrics/loggers.py: counted as requests finish / prefills complete).
REQUESTS_FINISHED = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
# The Mooncake store's counter family: declared (HELP/TYPE) at start-up, series from the first operation.
_STORE_FAMILY = "vllm:mooncake_store_operation_keys"
MODEL_LABEL = "model_name"


class MetricsFormatError(ValueError):
    """The text is not the Prometheus exposition format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


COUNTER_NAMES = frozenset(
    {
        EXTERNAL_HITS,
        EXTERNAL_QUERIES,
        LOCAL_HITS,
        PROMPT_TOKENS_BY_SOURCE,
        STORE_OPERATION_KEYS,
        STORE_FAILED_KEYS,
        SPEC_DECODE_DRAFTS,
        SPEC_DECODE_DRAFT_TOKENS,
        SPEC_DECODE_ACCEPTED_TOKENS,
        REQUESTS_FINISHED,
        PROMPT_TOKENS,
        REQUESTS_RUNNING,
        REQUESTS_WAITING,
    }
)
_VLLM_SAMPLE_LINE = re.compile(r"^\s*vllm:", re.MULTILINE)


def parse_samples(text: str, *, only: Collection[str] | None = None) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and blank lines skipped), each line read
    by prometheus_client's parser, one at a time so that an error names its line.

    With `only`, lines of other metrics are skipped before parsing: a vLLM page has hundreds of
    histogram buckets the canary does not read.
    """
    samples = []
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if only is not None and _metric_name(stripped) not in only:
            continue
        sample = _parse_line(stripped, number)
        series = (sample.name, tuple(sorted(sample.labels.items())))
        if only is not None:
            # The counters the canary sums: one value per series, finite and not negative, or the sum
            # would be wrong (a duplicate doubles a hit; NaN or Inf are no count).
            if series in seen:
                raise MetricsFormatError(f"line {number} repeats a series (duplicate): {stripped[:120]!r}")
            if not math.isfinite(sample.value) or sample.value < 0:
                raise MetricsFormatError(
                    f"line {number}: {sample.name} is not a finite count ({sample.value}): {stripped[:120]!r}"
                )
        seen.add(series)
        samples.append(sample)
    return samples


def _parse_line(line: str, number: int) -> Sample:
    try:
        [family] = text_string_to_metric_families(line + "\n")
        [parsed] = family.samples
    except (ValueError, IndexError) as error:  # the parser's errors (IndexError: on some hostile lines)
        what = (
            "has malformed labels"
            if str(error).startswith("Invalid labels")
            else "is not a Prometheus sample"
        )
        raise MetricsFormatError(f"line {number} {what}: {line[:120]!r} ({error})") from None
    return Sample(parsed.name, dict(parsed.labels), float(parsed.value))


class ModelSeriesError(ValueError):
    """The page has no series of the asked model, or several models and none was named."""


def select_model(samples: list[Sample], model: str | None) -> list[Sample]:
    """The samples of `model` (label `model_name`); never a sum across models.

    `model` None (the request named none, so vLLM served its only model): the page must carry one
    model. ModelSeriesError names the models on the page otherwise.
    """
    models = sorted({sample.labels[MODEL_LABEL] for sample in samples if MODEL_LABEL in sample.labels})
    if model is None:
        if len(models) > 1:
            raise ModelSeriesError(
                f"the page carries series of several models ({', '.join(models)}) and the request names "
                "none: name the model in the request (its 'model' field, or --model)"
            )
        if not models:
            return samples
        model = models[0]
    chosen = [sample for sample in samples if sample.labels.get(MODEL_LABEL) == model]
    if not any(sample.name == EXTERNAL_HITS for sample in chosen):
        shown = ", ".join(models) or "none"
        raise ModelSeriesError(
            f"no {EXTERNAL_HITS} series for model {model!r} (models on the page: {shown}): the replica "
            "does not serve the model the request names, or its series are labelled otherwise"
        )
    return chosen


def store_counters(
    samples: list[Sample], *, latency_s: float = 0.0, store_metrics_declared: bool | None = None
) -> StoreCounters:
    """The counters the canary reads, each summed over its label sets; None where a metric is absent.

    Pass one model's samples (`select_model`): the sum is over engines and statuses, not models.
    `store_metrics_declared`: whether the page declares the Mooncake store counters (`declares_store`);
    None: whether any of their samples is among `samples`."""
    if store_metrics_declared is None:
        store_metrics_declared = any(sample.name == STORE_OPERATION_KEYS for sample in samples)
    return StoreCounters(
        external_hit_tokens=_total(samples, EXTERNAL_HITS),
        external_query_tokens=_total(samples, EXTERNAL_QUERIES),
        local_hit_tokens=_total(samples, LOCAL_HITS),
        prompt_tokens_by_source=_by_label(samples, PROMPT_TOKENS_BY_SOURCE, "source"),
        store_keys_by_operation=_by_label(samples, STORE_OPERATION_KEYS, "operation"),
        store_failed_keys_by_operation=_by_label(samples, STORE_FAILED_KEYS, "operation"),
        spec_decode_drafts=_total(samples, SPEC_DECODE_DRAFTS),
        spec_decode_draft_tokens=_total(samples, SPEC_DECODE_DRAFT_TOKENS),
        spec_decode_accepted_tokens=_total(samples, SPEC_DECODE_ACCEPTED_TOKENS),
        requests_finished=_total(samples, REQUESTS_FINISHED),
        prompt_tokens=_total(samples, PROMPT_TOKENS),
        requests_running=_total(samples, REQUESTS_RUNNING),
        requests_waiting=_total(samples, REQUESTS_WAITING),
        store_metrics_declared=store_metrics_declared,
        latency_s=latency_s,
    )


def has_vllm_metrics(text: str) -> bool:
    return _VLLM_SAMPLE_LINE.search(text) is not None


def declares_store(text: str) -> bool:
    """Whether the page carries the Mooncake store's key counters (a sample, or the family's HELP/TYPE
    lines, which prometheus_client writes before the first operation creates a series)."""
    return _STORE_FAMILY in text


def expected_external_hit_tokens(prompt_tokens: int, block_size: int, *, eagle: bool) -> int:
    """Tokens a reader should load from the store for a prompt another replica fully stored.

    Mirrors vLLM 0.32's MooncakeStore lookup (`LookupKeyClient.lookup` in the connector's
    `worker.py`, `FullAttentionManager.find_longest_cache_hit`) for one full-attention KV cache
    group without partial-block hash hits: the writer stores the prompt's full blocks; the lookup
    walks those (`align_lookup_length(num_tokens)`); with Eagle it drops the last hit block so the
    drafter recomputes it; a hit covering the whole prompt is redone one token shorter, because
    the last prompt token must be computed to sample from. Measured: 185 tokens, block 32, Eagle
    -> 128. With Eagle and a prompt of whole blocks the drop already leaves the last token out,
    so the hit is (P // B - 1) blocks, not ((P - 1) // B - 1).
    """
    if prompt_tokens < 0 or block_size <= 0:
        raise ValueError(f"need prompt_tokens >= 0 and block_size > 0, got {prompt_tokens}, {block_size}")
    full_blocks = prompt_tokens // block_size
    hit_blocks = full_blocks - 1 if eagle else full_blocks
    if hit_blocks * block_size >= prompt_tokens:
        hit_blocks = (prompt_tokens - 1) // block_size
    return max(hit_blocks, 0) * block_size


def _metric_name(line: str) -> str:
    end = len(line)
    for separator in ("{", " ", "\t"):
        position = line.find(separator)
        if position != -1:
            end = min(end, position)
    return line[:end]


def _total(samples: list[Sample], name: str) -> int | None:
    values = [sample.value for sample in samples if sample.name == name]
    return _tokens(sum(values)) if values else None


def _by_label(samples: list[Sample], name: str, label: str) -> dict[str, int]:
    sums: dict[str, float] = {}
    for sample in samples:
        if sample.name == name:
            key = sample.labels.get(label, "")
            sums[key] = sums.get(key, 0.0) + sample.value
    return {key: _tokens(value) for key, value in sorted(sums.items())}


def _tokens(value: float) -> int:
    """Counters of tokens and keys are integral; Prometheus writes them as floats ("128.0").

    Non-finite values never get here from `parse_samples(only=...)`; elsewhere they are refused too.
    """
    if not math.isfinite(value):
        raise MetricsFormatError(f"{value} is not a finite count")
    return round(value)
