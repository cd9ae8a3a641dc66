"""Benign numerics or corruption: the per-token logprobs of a cold and a warm answer, parsed and judged.

Pure functions, no I/O. `parse_logprobs` reads an OpenAI `choices[0].logprobs` strictly (a replica
that returns impossible numbers is broken, and NaN logprobs are themselves a symptom of garbage KV).
`judge_divergence` finds the first token where the answers part and says whether the two
distributions explain it as a near tie tipped by numerics (docs/canary.md: the rule and its sources).
"""

from __future__ import annotations

import itertools
import math

from mooncake_operator.canary.models import (
    Comparison,
    Divergence,
    DivergenceKind,
    TokenLogprob,
    TopLogprob,
)


class LogprobsError(ValueError):
    """`choices[0].logprobs` is not what vLLM sends for the request: the answer is malformed."""


def parse_logprobs(raw: object, *, top_k: int, max_entries: int | None) -> list[TokenLogprob] | None:
    """The tokens of `choices[0].logprobs` (`{"content": [{token, logprob, top_logprobs}, ...]}`).

    None when the server sent none (`null` or absent). LogprobsError when the entries exceed
    `max_entries` (the request's max_tokens), a top list exceeds `top_k`, a logprob is not a finite
    number <= 0, a token is not text, or a top list is not sorted by logprob, descending. vLLM puts
    the sampled token first when it is not the most likely one (sampling, or raw logprobs of a
    processed distribution), so the order is checked after that leading entry.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise LogprobsError(f"logprobs is {type(raw).__name__}, not an object with 'content'")
    content = raw.get("content")
    if content is None:
        return None
    if not isinstance(content, list):
        raise LogprobsError(f"logprobs.content is {type(content).__name__}, not a list")
    if max_entries is not None and len(content) > max_entries:
        raise LogprobsError(
            f"logprobs.content has {len(content)} entries, more than the {max_entries} tokens asked for"
        )
    tokens = []
    for position, entry in enumerate(content):
        where = f"logprobs.content[{position}]"
        if not isinstance(entry, dict):
            raise LogprobsError(f"{where} is {type(entry).__name__}, not an object")
        token = _token(entry.get("token"), where)
        logprob = _logprob(entry.get("logprob"), where)
        top_raw = entry.get("top_logprobs")
        if top_raw is None:
            top_raw = []
        if not isinstance(top_raw, list):
            raise LogprobsError(f"{where}.top_logprobs is {type(top_raw).__name__}, not a list")
        if len(top_raw) > top_k:
            raise LogprobsError(
                f"{where}.top_logprobs has {len(top_raw)} entries, more than the {top_k} asked"
            )
        top = []
        for rank, item in enumerate(top_raw):
            item_where = f"{where}.top_logprobs[{rank}]"
            if not isinstance(item, dict):
                raise LogprobsError(f"{item_where} is {type(item).__name__}, not an object")
            top.append(
                TopLogprob(
                    token=_token(item.get("token"), item_where),
                    logprob=_logprob(item.get("logprob"), item_where),
                )
            )
        ordered = top[1:] if top and top[0].token == token else top
        for earlier, later in itertools.pairwise(ordered):
            if later.logprob > earlier.logprob:
                raise LogprobsError(
                    f"{where}.top_logprobs is not sorted by logprob, descending "
                    f"({earlier.token!r} {earlier.logprob} before {later.token!r} {later.logprob})"
                )
        tokens.append(TokenLogprob(token=token, logprob=logprob, top=top))
    return tokens


def first_token_difference(cold: list[TokenLogprob], warm: list[TokenLogprob]) -> int | None:
    """Index of the first differing token (or where the shorter answer ends); None when equal."""
    for position, (a, b) in enumerate(zip(cold, warm, strict=False)):
        if a.token != b.token:
            return position
    return None if len(cold) == len(warm) else min(len(cold), len(warm))


def judge_divergence(
    cold: list[TokenLogprob] | None, warm: list[TokenLogprob] | None, comparison: Comparison
) -> Divergence | None:
    """The first divergence of two token sequences, judged; None when the tokens are identical.

    Benign only when all hold:
    1. both answers have a token there (an answer that ends where the other goes on is not a tie);
    2. each side's token is in the other's top list (vLLM's check_logprobs_close);
    3. in each side's distribution, its own token and the other's are at most `max_tie_gap_nats`
       apart (a near tie that a numeric shift of that size can tip; LMCache's 0.1-nat rule);
    4. every shared token before it moved by at most `max_drift_nats` between cold and warm.
    Without logprobs on either side it cannot be judged (UNJUDGED).
    """
    if cold is None or warm is None:
        return None
    position = first_token_difference(cold, warm)
    if position is None:
        return None
    cold_entry = cold[position] if position < len(cold) else None
    warm_entry = warm[position] if position < len(warm) else None
    drift, drift_position = _drift(cold[:position], warm[:position])
    cold_gap, warm_token_rank = _gap(cold_entry, warm_entry)
    warm_gap, cold_token_rank = _gap(warm_entry, cold_entry)
    reasons = []
    if cold_entry is None or warm_entry is None:
        ended, going = ("cold", "warm") if cold_entry is None else ("warm", "cold")
        reasons.append(f"the {ended} answer ends at token {position} where the {going} one goes on")
    else:
        for side, other, gap in (("cold", "warm", cold_gap), ("warm", "cold", warm_gap)):
            if gap is None:
                reasons.append(f"the {other} token is not in the {side} answer's top-{comparison.top_k}")
            elif gap > comparison.max_tie_gap_nats:
                reasons.append(
                    f"the {side} answer's gap between the two tokens is {gap:.4f} nat, more than "
                    f"{comparison.max_tie_gap_nats:g} (not a near tie)"
                )
    if drift is not None and drift > comparison.max_drift_nats:
        reasons.append(
            f"the shared tokens' logprobs drifted by up to {drift:.4f} nat (token {drift_position}), "
            f"more than {comparison.max_drift_nats:g}"
        )
    return Divergence(
        position=position,
        cold_token=cold_entry.token if cold_entry else None,
        warm_token=warm_entry.token if warm_entry else None,
        kind=DivergenceKind.CORRUPTION if reasons else DivergenceKind.BENIGN,
        cold_gap_nats=cold_gap,
        warm_gap_nats=warm_gap,
        warm_token_rank_in_cold=warm_token_rank,
        cold_token_rank_in_warm=cold_token_rank,
        shared_tokens=position,
        max_drift_nats=drift,
        drift_position=drift_position,
        top_k=comparison.top_k,
        max_tie_gap_nats_allowed=comparison.max_tie_gap_nats,
        max_drift_nats_allowed=comparison.max_drift_nats,
        reasons=reasons,
    )


def unjudged_divergence(comparison: Comparison, *, missing: str) -> Divergence:
    """Answers that differ while `missing` sent no logprobs: no evidence either way."""
    return Divergence(
        position=0,
        kind=DivergenceKind.UNJUDGED,
        top_k=comparison.top_k,
        max_tie_gap_nats_allowed=comparison.max_tie_gap_nats,
        max_drift_nats_allowed=comparison.max_drift_nats,
        reasons=[f"the {missing} sent no logprobs, so the divergence cannot be judged"],
    )


def _gap(own: TokenLogprob | None, other: TokenLogprob | None) -> tuple[float | None, int | None]:
    """In `own`'s distribution: |logprob(own token) - logprob(other's token)| and that token's rank."""
    if own is None or other is None:
        return None, None
    for rank, item in enumerate(own.top, start=1):
        if item.token == other.token:
            return abs(own.logprob - item.logprob), rank
    return None, None


def _drift(cold: list[TokenLogprob], warm: list[TokenLogprob]) -> tuple[float | None, int | None]:
    if not cold:
        return None, None
    drifts = [abs(a.logprob - b.logprob) for a, b in zip(cold, warm, strict=True)]
    largest = max(range(len(drifts)), key=drifts.__getitem__)
    return drifts[largest], largest


def _token(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise LogprobsError(f"{where}.token is {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LogprobsError(f"{where}.token is not valid Unicode text (a lone surrogate escape)") from None
    return value


def _logprob(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LogprobsError(f"{where}.logprob is {type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number) or number > 0:
        raise LogprobsError(f"{where}.logprob is {value}: a log-probability is a finite number <= 0")
    return number
