"""Benign numerics or corruption: the per-token logprobs of a cold and a warm answer, by token id.

Pure functions, no I/O. `parse_logprobs` reads an OpenAI `choices[0].logprobs` strictly, tokens as vLLM's
`token_id:N` placeholders (`return_tokens_as_token_ids`): a replica that returns impossible numbers is
broken (malformed: Failed; NaN logprobs are themselves a symptom of garbage KV), one whose tokens are not
ids or whose top lists are short cannot be judged (Inconclusive). `judge_tokens` compares the two
distributions at every position the answers share and judges their first divergence
(docs/canary.md: the rules and their sources).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from mooncake_operator.canary.models import (
    Comparison,
    Divergence,
    DivergenceKind,
    LogprobEvidence,
    TokenLogprob,
    TopLogprob,
    token_name,
)

# vLLM's placeholder for a token when `return_tokens_as_token_ids` is set (format_token_id_placeholder).
_TOKEN_ID = re.compile(r"token_id:(\d{1,12})")
# The sampled token's logprob and its own entry in the top list are one number, serialized twice.
_SAME_LOGPROB = 1e-9


class LogprobsError(ValueError):
    """`choices[0].logprobs` is not what vLLM can send for the request: the answer is malformed."""


class LogprobsUnusable(ValueError):
    """`choices[0].logprobs` is well formed but cannot be judged (tokens that are not ids, short top
    lists): the comparison is Inconclusive, never Passed."""


def parse_logprobs(raw: object, *, top_k: int, max_entries: int | None) -> list[TokenLogprob] | None:
    """The tokens of `choices[0].logprobs` (`{"content": [{token, logprob, top_logprobs}, ...]}`).

    None when the server sent none (`null` or absent). LogprobsError when the entries exceed
    `max_entries` (the request's max_tokens), a top list exceeds `top_k` or repeats a token, a logprob
    is not a finite number <= 0, a token is not text, the sampled token's own top entry has another
    logprob than the token, or a top list is not sorted by logprob, descending (vLLM puts the sampled
    token first, then the top tokens by rank, so the order is checked after a leading sampled token).
    LogprobsUnusable when every entry is well formed but a token is not `token_id:N` or a top list has
    fewer than `top_k` entries (vLLM always sends exactly `top_logprobs`): no bound on the tokens it
    leaves out. The `bytes` fields are not read: with token ids vLLM sends the placeholder's bytes for
    the top entries and the replacement-decoded text's for the sampled one, neither a token's bytes.
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
    unusable: str | None = None
    tokens = []
    for position, entry in enumerate(content):
        where = f"logprobs.content[{position}]"
        if not isinstance(entry, dict):
            raise LogprobsError(f"{where} is {type(entry).__name__}, not an object")
        token_id, problem = _token_id(entry.get("token"), where)
        unusable = unusable or problem
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
            item_id, problem = _token_id(item.get("token"), item_where)
            unusable = unusable or problem
            top.append(TopLogprob(token_id=item_id, logprob=_logprob(item.get("logprob"), item_where)))
        _check_top_list(top, token_id, logprob, where, known_ids=problem is None and unusable is None)
        if len(top) < top_k:
            unusable = unusable or (
                f"{where}.top_logprobs has {len(top)} entries, fewer than the {top_k} asked: the tokens it "
                "leaves out have no bound"
            )
        tokens.append(TokenLogprob(token_id=token_id, logprob=logprob, top=top))
    if unusable is not None:
        raise LogprobsUnusable(unusable)
    return tokens


def _check_top_list(
    top: list[TopLogprob], token_id: int, logprob: float, where: str, *, known_ids: bool
) -> None:
    if known_ids:
        ids = [item.token_id for item in top]
        repeated = sorted({token for token in ids if ids.count(token) > 1})
        if repeated:
            raise LogprobsError(f"{where}.top_logprobs repeats token_id:{repeated[0]}")
        own = [item.logprob for item in top if item.token_id == token_id]
        if own and abs(own[0] - logprob) > _SAME_LOGPROB:
            raise LogprobsError(
                f"{where}: the sampled token_id:{token_id} has logprob {logprob} but {own[0]} in its top list"
            )
    ordered = top[1:] if known_ids and top and top[0].token_id == token_id else top
    for earlier, later in itertools.pairwise(ordered):
        if later.logprob > earlier.logprob:
            raise LogprobsError(
                f"{where}.top_logprobs is not sorted by logprob, descending "
                f"({token_name(earlier.token_id)} {earlier.logprob} before "
                f"{token_name(later.token_id)} {later.logprob})"
            )


@dataclass(frozen=True)
class Distribution:
    """What one answer says about the next-token distribution at one position: the logprobs of the
    tokens it lists (its top list and its sampled token), and a bound on every token it leaves out."""

    logprobs: dict[int, float]
    # Every token not listed has a logprob <= bound: the top list's last entry. vLLM's list is the
    # sampled token, then the top tokens by rank, cut to top_k; a token left out ranks below every
    # ranked entry listed, so below the last one (whether or not the sampled token is among the top).
    bound: float | None


def distribution(entry: TokenLogprob) -> Distribution:
    logprobs = {item.token_id: item.logprob for item in entry.top}
    logprobs.setdefault(entry.token_id, entry.logprob)
    return Distribution(logprobs, entry.top[-1].logprob if entry.top else None)


@dataclass(frozen=True)
class Drift:
    """The largest cold-versus-warm change of one token's logprob at one position."""

    nats: float
    token_id: int
    # True: the token is in one side's list only, and `nats` is how far it is above the other side's
    # bound (the change is at least that).
    bounded: bool


def drift_at(cold: Distribution, warm: Distribution) -> Drift | None:
    """The largest change over the union of both sides' listed tokens; None when nothing is evidence
    (a token listed on one side only, at or below the other side's bound, may not have moved)."""
    largest: Drift | None = None
    for token_id in sorted(cold.logprobs.keys() | warm.logprobs.keys()):
        here, there = cold.logprobs.get(token_id), warm.logprobs.get(token_id)
        if here is not None and there is not None:
            found = Drift(abs(here - there), token_id, bounded=False)
        else:
            listed, other_bound = (here, warm.bound) if here is not None else (there, cold.bound)
            assert listed is not None
            if other_bound is None or listed <= other_bound:
                continue
            found = Drift(listed - other_bound, token_id, bounded=True)
        if largest is None or found.nats > largest.nats:
            largest = found
    return largest


def first_token_difference(cold: list[TokenLogprob], warm: list[TokenLogprob]) -> int | None:
    """Index of the first differing token id (or where the shorter answer ends); None when equal."""
    for position, (a, b) in enumerate(zip(cold, warm, strict=False)):
        if a.token_id != b.token_id:
            return position
    return None if len(cold) == len(warm) else min(len(cold), len(warm))


@dataclass(frozen=True)
class TokenJudgement:
    """The two token sequences compared: the drift over every shared distribution and the first
    divergence, judged (None: identical ids). `drift_problem` says why the drift alone is corruption."""

    evidence: LogprobEvidence
    divergence: Divergence | None
    drift_problem: str | None


def judge_tokens(
    cold: list[TokenLogprob], warm: list[TokenLogprob], comparison: Comparison
) -> TokenJudgement:
    """Compare two generations by token id.

    Every position both answers reach with the same prefix (all shared tokens, and the divergence
    itself) is compared over the union of both top lists (`drift_at`); a change above
    `max_drift_nats` anywhere is corruption, identical tokens or not: a distribution that moved by
    whole nats is garbage KV even where greedy decoding picked the same token.

    At the first divergence it is benign only when all hold:
    1. both answers have a token there (an answer that ends where the other goes on is not a tie);
    2. each side's token is in the other's top list (vLLM's check_logprobs_close);
    3. in each side's distribution, its own token and the other's are at most `max_tie_gap_nats`
       apart (a near tie that a numeric shift of that size can tip; LMCache's 0.1-nat rule);
    4. each of the two tokens has the same logprob cold and warm within `max_drift_nats`, and so has
       every other listed token there and at every shared position before it.
    """
    position = first_token_difference(cold, warm)
    reach = min(len(cold), len(warm)) if position is None else position
    # The divergence position shares the prefix too: compared when both answers have a token there.
    compared = reach + 1 if position is not None and position < min(len(cold), len(warm)) else reach
    largest: Drift | None = None
    where: int | None = None
    for index in range(compared):
        found = drift_at(distribution(cold[index]), distribution(warm[index]))
        if found is not None and (largest is None or found.nats > largest.nats):
            largest, where = found, index
    evidence = LogprobEvidence(
        positions=compared,
        max_drift_nats=largest.nats if largest else None,
        drift_position=where,
        drift_token_id=largest.token_id if largest else None,
        drift_bounded=largest.bounded if largest else False,
        max_drift_nats_allowed=comparison.max_drift_nats,
    )
    drift_problem = None
    if largest is not None and largest.nats > comparison.max_drift_nats:
        how = "by at least" if largest.bounded else "by"
        drift_problem = (
            f"the distributions moved {how} {largest.nats:.4f} nat at token {where} "
            f"({token_name(largest.token_id)}), more than {comparison.max_drift_nats:g}: corruption even "
            "where the same token was picked"
        )
    divergence = None
    if position is not None:
        divergence = _judge_divergence(cold, warm, position, comparison, evidence, drift_problem)
    return TokenJudgement(evidence, divergence, drift_problem)


def judge_divergence(
    cold: list[TokenLogprob] | None, warm: list[TokenLogprob] | None, comparison: Comparison
) -> Divergence | None:
    """The first divergence of two token sequences, judged (`judge_tokens`); None when identical."""
    if cold is None or warm is None:
        return None
    return judge_tokens(cold, warm, comparison).divergence


def _judge_divergence(
    cold: list[TokenLogprob],
    warm: list[TokenLogprob],
    position: int,
    comparison: Comparison,
    evidence: LogprobEvidence,
    drift_problem: str | None,
) -> Divergence:
    cold_entry = cold[position] if position < len(cold) else None
    warm_entry = warm[position] if position < len(warm) else None
    cold_gap, warm_token_rank = _gap(cold_entry, warm_entry)
    warm_gap, cold_token_rank = _gap(warm_entry, cold_entry)
    cold_token_drift = warm_token_drift = None
    reasons = []
    if cold_entry is None or warm_entry is None:
        ended, going = ("cold", "warm") if cold_entry is None else ("warm", "cold")
        reasons.append(f"the {ended} answer ends at token {position} where the {going} one goes on")
    else:
        cold_dist, warm_dist = distribution(cold_entry), distribution(warm_entry)
        cold_token_drift = _token_drift(cold_entry.token_id, cold_dist, warm_dist)
        warm_token_drift = _token_drift(warm_entry.token_id, cold_dist, warm_dist)
        for side, other, gap in (("cold", "warm", cold_gap), ("warm", "cold", warm_gap)):
            if gap is None:
                reasons.append(f"the {other} token is not in the {side} answer's top-{comparison.top_k}")
            elif gap > comparison.max_tie_gap_nats:
                reasons.append(
                    f"the {side} answer's gap between the two tokens is {gap:.4f} nat, more than "
                    f"{comparison.max_tie_gap_nats:g} (not a near tie)"
                )
        for which, drift in (("cold", cold_token_drift), ("warm", warm_token_drift)):
            if drift is not None and drift > comparison.max_drift_nats:
                reasons.append(
                    f"the {which} answer's token moved by {drift:.4f} nat between cold and warm, more than "
                    f"{comparison.max_drift_nats:g} (a tie of two sunken tokens is no tie)"
                )
    if drift_problem is not None:
        reasons.append(drift_problem)
    return Divergence(
        position=position,
        cold_token=token_name(cold_entry.token_id if cold_entry else None),
        warm_token=token_name(warm_entry.token_id if warm_entry else None),
        cold_token_id=cold_entry.token_id if cold_entry else None,
        warm_token_id=warm_entry.token_id if warm_entry else None,
        cold_token_drift_nats=cold_token_drift,
        warm_token_drift_nats=warm_token_drift,
        kind=DivergenceKind.CORRUPTION if reasons else DivergenceKind.BENIGN,
        cold_gap_nats=cold_gap,
        warm_gap_nats=warm_gap,
        warm_token_rank_in_cold=warm_token_rank,
        cold_token_rank_in_warm=cold_token_rank,
        shared_tokens=position,
        max_drift_nats=evidence.max_drift_nats,
        drift_position=evidence.drift_position,
        top_k=comparison.top_k,
        max_tie_gap_nats_allowed=comparison.max_tie_gap_nats,
        max_drift_nats_allowed=comparison.max_drift_nats,
        reasons=reasons,
    )


def unjudged_divergence(comparison: Comparison, *, missing: str) -> Divergence:
    """Answers that differ while `missing` sent no usable logprobs: no evidence either way."""
    return Divergence(
        position=0,
        kind=DivergenceKind.UNJUDGED,
        top_k=comparison.top_k,
        max_tie_gap_nats_allowed=comparison.max_tie_gap_nats,
        max_drift_nats_allowed=comparison.max_drift_nats,
        reasons=[f"the {missing} sent no usable logprobs, so the divergence cannot be judged"],
    )


def _token_drift(token_id: int, cold: Distribution, warm: Distribution) -> float | None:
    here, there = cold.logprobs.get(token_id), warm.logprobs.get(token_id)
    return None if here is None or there is None else abs(here - there)


def _gap(own: TokenLogprob | None, other: TokenLogprob | None) -> tuple[float | None, int | None]:
    """In `own`'s distribution: |logprob(own token) - logprob(other's token)| and that token's rank."""
    if own is None or other is None:
        return None, None
    for rank, item in enumerate(own.top, start=1):
        if item.token_id == other.token_id:
            return abs(own.logprob - item.logprob), rank
    return None, None


def _token_id(value: object, where: str) -> tuple[int, str | None]:
    """The id of a `token_id:N` token, or (0, why not) for a text token (judged unusable)."""
    if not isinstance(value, str):
        raise LogprobsError(f"{where}.token is {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LogprobsError(f"{where}.token is not valid Unicode text (a lone surrogate escape)") from None
    match = _TOKEN_ID.fullmatch(value)
    if match is None:
        return 0, (
            f"{where}.token is {value[:40]!r}, not a token id (token_id:N): the replica ignored "
            "return_tokens_as_token_ids, so equal text may hide different tokens"
        )
    return int(match.group(1)), None


def _logprob(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LogprobsError(f"{where}.logprob is {type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number) or number > 0:
        raise LogprobsError(f"{where}.logprob is {value}: a log-probability is a finite number <= 0")
    return number
