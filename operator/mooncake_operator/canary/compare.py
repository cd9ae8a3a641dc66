"""Comparing a warm answer with the cold one: token ids, their distributions, and the text they explain.

Pure functions, no I/O (the text of the shared tokens before a divergence is decoded by the runner and
passed in). docs/canary.md states each rule and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake_operator.canary.divergence import judge_tokens, unjudged_divergence
from mooncake_operator.canary.models import (
    ChatAnswer,
    Comparison,
    ComparisonMode,
    Divergence,
    DivergenceKind,
    LogprobEvidence,
    Mismatch,
    SharedText,
)

_CONTEXT_BEFORE = 20
_CONTEXT_AFTER = 40
# Markers a reasoning parser removes from the text it splits (the generation's raw text has them, the
# reasoning and content fields do not): dropped from the shared text before it is compared.
_REASONING_MARKERS = ("<think>", "</think>")
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class AnswerComparison:
    """What comparing a warm answer with the cold one found."""

    mismatch: Mismatch | None = None  # first differing character of the generations (for people)
    divergence: Divergence | None = None  # first differing token, judged
    failures: list[str] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)  # no evidence either way: Inconclusive
    notes: list[str] = field(default_factory=list)
    evidence: LogprobEvidence | None = None

    @property
    def proven_equal(self) -> bool:
        """Token for token, distribution for distribution, text for text (within the bounds)."""
        return not self.failures and not self.unjudged and self.divergence is None


def evidence_problems(cold: ChatAnswer, warm: ChatAnswer) -> list[str]:
    """Why the answers' logprobs cannot be compared: absent, not token ids, short top lists, or not
    covering the answer its usage counts (a proxy that strips or cuts them). Empty: they can."""
    problems = []
    for role, answer in (("cold", cold), ("warm", warm)):
        tokens = answer.logprobs
        if tokens is None and answer.logprobs_problem is not None:
            problems.append(f"the {role} answer's logprobs cannot be judged: {answer.logprobs_problem}")
        elif tokens is None:
            problems.append(f"the {role} answer sent no logprobs (a proxy that strips them?)")
        elif answer.completion_tokens is None:
            problems.append(
                f"the {role} answer has no usage.completion_tokens, so its logprobs cannot be shown to "
                "cover the whole answer"
            )
        elif len(tokens) != answer.completion_tokens:
            problems.append(
                f"the {role} answer's logprobs cover {len(tokens)} tokens but its usage counts "
                f"{answer.completion_tokens}: they do not align with the answer"
            )
    return problems


def shared_tokens_to_decode(cold: ChatAnswer, warm: ChatAnswer, comparison: Comparison) -> list[int] | None:
    """The token ids whose text must be checked against both answers: those before a divergence that is
    otherwise benign (None: no such divergence, nothing to decode)."""
    if comparison.mode is ComparisonMode.EXACT or evidence_problems(cold, warm):
        return None
    assert cold.logprobs is not None and warm.logprobs is not None
    divergence = judge_tokens(cold.logprobs, warm.logprobs, comparison).divergence
    if divergence is None or divergence.kind is not DivergenceKind.BENIGN or divergence.position == 0:
        return None
    return [token.token_id for token in cold.logprobs[: divergence.position]]


def compare_answers(
    cold: ChatAnswer,
    warm: ChatAnswer,
    comparison: Comparison | None = None,
    shared_text: SharedText | None = None,
) -> AnswerComparison:
    """Compare by token id, over every shared distribution (`judge_tokens`), in both modes.

    Identical ids pass when the distributions agree and the texts (content and reasoning) are identical.
    Exact: any divergence fails. Logprobs: a benign divergence passes with a note when both texts agree
    over the text of the shared tokens before it (`shared_text`, decoded by the writer: without it the
    pair cannot be judged); a corruption fails. Logprobs that cannot be compared (absent, not ids, short,
    misaligned) are Inconclusive, equal text or not: equal text shows neither equal tokens nor equal
    distributions. Texts that differ are Failed in exact mode whatever the logprobs."""
    comparison = comparison or Comparison()
    failures: list[str] = []
    unjudged: list[str] = []
    notes: list[str] = []
    mismatch = _mismatch(cold.generation, warm.generation)
    text_problems = _text_problems(cold, warm, mismatch)
    exact = comparison.mode is ComparisonMode.EXACT
    divergence = evidence = None
    problems = evidence_problems(cold, warm)
    if problems:
        if exact and text_problems:
            failures.extend(text_problems)
        elif text_problems:
            divergence = unjudged_divergence(comparison, missing=" and ".join(_sides(problems)) + " answer")
            unjudged.append(
                f"{text_problems[0]}; whether it is benign cannot be judged: {'; '.join(problems)} "
                "(comparison mode exact demands equal text)"
            )
        else:
            unjudged.append(
                "the answers' texts are equal, but equal text shows neither equal tokens nor equal "
                f"distributions: {'; '.join(problems)}"
            )
    else:
        assert cold.logprobs is not None and warm.logprobs is not None
        judgement = judge_tokens(cold.logprobs, warm.logprobs, comparison)
        evidence, divergence = judgement.evidence, judgement.divergence
        if divergence is None:
            failures.extend(f"{problem} although the token ids are identical" for problem in text_problems)
            if judgement.drift_problem is not None:
                failures.append(
                    f"the warm answer's token ids equal the cold one's, but {judgement.drift_problem}"
                )
        elif exact:
            failures.append(
                f"warm answer diverges from the cold one (exact comparison: no divergence allowed): "
                f"{divergence.describe()}"
                + (f"; {'; '.join(divergence.reasons)}" if divergence.reasons else "")
            )
        elif divergence.kind is DivergenceKind.CORRUPTION:
            failures.append(
                f"warm answer diverges from the cold one: {divergence.describe()}; not benign: "
                + "; ".join(divergence.reasons)
            )
        else:
            problem, unclear = _shared_text_problem(cold, warm, divergence, shared_text)
            if problem is not None:
                failures.append(problem)
            elif unclear is not None:
                unjudged.append(unclear)
            else:
                notes.append(f"passed over a {divergence.describe()}")
    if cold.prompt_tokens != warm.prompt_tokens:
        failures.append(
            f"the replicas counted different prompt tokens (cold {cold.prompt_tokens}, warm "
            f"{warm.prompt_tokens}): they do not tokenize the request alike"
        )
    return AnswerComparison(mismatch, divergence, failures, unjudged, notes, evidence)


def shared_prefix(decoded: str) -> str:
    """The text of the shared tokens as both answers must show it: without the reasoning markers a
    parser removes, and without a trailing partial character (a byte-fallback token whose character
    the next, differing, tokens complete decodes to U+FFFD on its own)."""
    for marker in _REASONING_MARKERS:
        decoded = decoded.replace(marker, "")
    return decoded.rstrip(_REPLACEMENT)


def _shared_text_problem(
    cold: ChatAnswer, warm: ChatAnswer, divergence: Divergence, shared_text: SharedText | None
) -> tuple[str | None, str | None]:
    """(a failure, or why it cannot be checked): the texts must agree over the shared tokens' text."""
    if divergence.position == 0:
        return None, None
    if shared_text is None or shared_text.tokens != divergence.position:
        return None, (
            f"the text of the {divergence.position} tokens before the divergence was not decoded, so it "
            "cannot be shown that the answers' texts agree up to it"
        )
    if shared_text.text is None:
        return None, (
            f"the text of the {divergence.position} tokens before the divergence could not be decoded "
            f"({shared_text.error}), so it cannot be shown that the answers' texts agree up to it"
        )
    length = len(shared_prefix(shared_text.text))
    position = first_difference(cold.generation, warm.generation)
    if position is not None and position < length:
        return (
            f"the answers' texts differ at character {position}, inside the text of the "
            f"{divergence.position} tokens they share (its first {length} characters): the texts are not "
            f"what the token ids say ({divergence.describe()})"
        ), None
    return None, None


def _text_problems(cold: ChatAnswer, warm: ChatAnswer, mismatch: Mismatch | None) -> list[str]:
    problems = []
    if cold.text != warm.text:
        position = first_difference(cold.text or "", warm.text or "")
        context = _mismatch(cold.text or "", warm.text or "")
        assert context is not None
        problems.append(
            f"warm answer differs from the cold one at character {position}: "
            f"cold {context.cold!r}, warm {context.warm!r}"
            + ("" if (cold.text is None) == (warm.text is None) else " (one answer has no content)")
        )
    if cold.reasoning != warm.reasoning:
        reasoning_position = first_difference(cold.reasoning or "", warm.reasoning or "")
        problems.append(f"warm reasoning differs from the cold one at character {reasoning_position}")
    return problems


def _sides(problems: list[str]) -> list[str]:
    return [side for side in ("cold", "warm") if any(f"the {side} answer" in problem for problem in problems)]


def _mismatch(cold: str, warm: str) -> Mismatch | None:
    position = first_difference(cold, warm)
    if position is None:
        return None
    return Mismatch(position=position, cold=_context(cold, position), warm=_context(warm, position))


def first_difference(first: str, second: str) -> int | None:
    """Index of the first character where the texts differ (or the shorter one ends); None if equal."""
    if first == second:
        return None
    shorter = min(len(first), len(second))
    # Compare blocks in C first, then characters within the first block that differs: linear and fast.
    block = 4096
    start = 0
    while start < shorter and first[start : start + block] == second[start : start + block]:
        start += block
    for index in range(start, min(start + block, shorter)):
        if first[index] != second[index]:
            return index
    return shorter


def _context(text: str, position: int) -> str:
    start = max(0, position - _CONTEXT_BEFORE)
    return text[start : position + _CONTEXT_AFTER]
