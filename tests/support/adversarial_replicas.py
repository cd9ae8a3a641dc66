"""Adversarial fake replicas: one per class of issue 31 and its neighbours, each a FakeReplica whose
answers computed from a loaded prefix (or every answer) lie in one way. The canary must judge them by
its rules; nothing here is known to the canary.

Each class changes what the replica returns (`shape_tokens`, `shape_payload`); the store, the hit
arithmetic and the counters stay the fake's own (tests/support/fake_vllm.py).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from tests.support.fake_vllm import (
    VOCAB,
    Admission,
    FakeReplica,
    Token,
    healthy_token,
    logprobs_payload,
    tokens_for,
)

# The superseded values a corrupted answer writes, as the seed's deployment showed.
SUPERSEDED = '{"region": "us-east", "replica_count": 2, "max_batch_size": 8}'


def _tie(chosen: int, other: int, *, gap: float, shift: float = 0.0) -> Token:
    """`chosen` sampled, `other` `gap` nat below it, then the usual alternatives; `shift` lowers all."""
    base = healthy_token(chosen)
    rest = tuple((token_id, logprob - shift) for token_id, logprob in base.top[1:] if token_id != other)
    top = ((chosen, -0.7 - shift), (other, -0.7 - gap - shift), *rest)
    return Token(chosen, -0.7 - shift, top)


def _payload_text(payload: dict[str, Any], tokens: list[Token]) -> None:
    """Set the message's content to the text of `tokens` (no reasoning)."""
    payload["choices"][0]["message"]["content"] = VOCAB.decode([token.token_id for token in tokens])


class MovedDistribution(FakeReplica):
    """Class 1: a loaded answer has the cold tokens, but every logprob sits `nats` lower (and the top
    lists with them): greedy decoding picked the same tokens from a garbage distribution."""

    nats = 1.6

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        if not admission.loaded:
            return tokens
        return [token.shifted(self.nats) for token in tokens]


class RunnerUpDrift(FakeReplica):
    """Class 2: confident tokens whose runner-up (a token below the cold top list, at -9 nat) rose to
    -3.5 nat on a loaded answer while the sampled token only moved -0.0005 -> -0.05; then a near tie
    "explains" a divergence after which the loaded answer writes superseded values."""

    runner_up = VOCAB.word("<runner-up>")

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        shaped = [self._confident(token.token_id, loaded=admission.loaded) for token in tokens]
        superseded = [self._confident(token.token_id, loaded=True) for token in tokens_for(SUPERSEDED)]
        # Where the answer and the superseded values part ("west" / "east"): a near tie on both sides,
        # which a loaded answer tips, then goes on with the superseded values.
        position = next(
            (i for i, (a, b) in enumerate(zip(shaped, superseded, strict=False)) if a.token_id != b.token_id),
            None,
        )
        if position is None:
            return shaped
        original, other = shaped[position].token_id, superseded[position].token_id
        if not admission.loaded:
            return [*shaped[:position], _tie(original, other, gap=0.02), *shaped[position + 1 :]]
        return [*shaped[:position], _tie(other, original, gap=0.02), *superseded[position + 1 :]]

    def _confident(self, token_id: int, *, loaded: bool) -> Token:
        alternatives = [VOCAB.word(f"<alt{rank}>") for rank in range(4)]
        if loaded:
            top = (
                (token_id, -0.05),
                (self.runner_up, -3.5),
                *((a, -7.0 - r / 2) for r, a in enumerate(alternatives)),
            )
            return Token(token_id, -0.05, top)
        top = (
            (token_id, -0.0005),
            *((a, -7.0 - r / 2) for r, a in enumerate(alternatives)),
            (self.runner_up, -9.0),
        )
        return Token(token_id, -0.0005, top)


class FlattenedTie(FakeReplica):
    """Class 3: the answer's first token is a near tie (0.02 nat) between two tokens; on a loaded answer
    both sank 1.8 nat, stayed 0.02 apart, the other one is sampled, and superseded values follow."""

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        if not tokens:
            return tokens
        first, other = tokens[0].token_id, VOCAB.word("<other-first>")
        if not admission.loaded:
            return [_tie(first, other, gap=0.02), *tokens[1:]]
        return [_tie(other, first, gap=0.02, shift=1.8), *tokens_for(SUPERSEDED)]


class ByteFallbackLie(FakeReplica):
    """Class 5: answers hold a CJK character (byte-fallback tokens). A loaded answer keeps the cold ids
    up to a near tie near the end, but its text names another character before it: ids that say one
    thing, text another (with text tokens both decode to U+FFFD)."""

    cold_text = '{"region": "区域 us-west", "replica_count": 4, "max_batch_size": 16}'
    warm_text = '{"region": "区城 us-west", "replica_count": 4, "max_batch_size": 16}'

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        shaped = tokens_for(self.cold_text)
        # The same ids on both sides up to a near tie at the next-to-last token, which a loaded answer tips.
        original, other = shaped[-2].token_id, VOCAB.word("<close>")
        tie = _tie(other, original, gap=0.02) if admission.loaded else _tie(original, other, gap=0.02)
        return [*shaped[:-2], tie, shaped[-1]]

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        message = payload["choices"][0]["message"]
        content = message["content"]
        if admission.loaded and isinstance(content, str):
            message["content"] = content.replace("区域", "区城")
        return payload


class BenignTie(FakeReplica):
    """Healthy GPU numerics: every answer has a near tie (0.03 nat) at its next-to-last token, and a loaded
    answer, its logprobs moved by 0.02 nat everywhere, tips it. Passes, reported."""

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        if len(tokens) < 2:
            return tokens
        # The runner-up writes the same value another way (" 16" / " 16.0"): the answer stays right.
        original = tokens[-2].token_id
        other = VOCAB.word(VOCAB.text(original) + ".0")
        if not admission.loaded:
            return [*tokens[:-2], _tie(original, other, gap=0.03), tokens[-1]]
        shifted = [token.shifted(0.02) for token in tokens]
        return [*shifted[:-2], _tie(other, original, gap=0.03, shift=0.02), shifted[-1]]


class BenignNoise(FakeReplica):
    """Healthy GPU numerics: a loaded answer has the cold tokens, every logprob 0.02 nat lower (under the
    0.1 bound): identical tokens, a distribution within numerics."""

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        return [token.shifted(0.02) for token in tokens] if admission.loaded else tokens


class TextTokens(FakeReplica):
    """Class 5's neighbour: a server that ignores return_tokens_as_token_ids (tokens as text, so two
    different characters' byte-fallback tokens are both U+FFFD)."""

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        choice = payload["choices"][0]
        if "logprobs" in choice:
            ids = [int(entry["token"].split(":")[1]) for entry in choice["logprobs"]["content"]]
            tokens = [healthy_token(token_id) for token_id in ids]
            top = len(choice["logprobs"]["content"][0]["top_logprobs"]) if ids else 0
            choice["logprobs"] = logprobs_payload(tokens, top, as_ids=False)
        return payload


class RepeatedKey(FakeReplica):
    """Class 7: every answer repeats a key, the superseded value first: the last value wins in a
    parser, so json_object_only and json_values_exclude alone would see only us-west."""

    text = '{"region": "us-east", "region": "us-west", "replica_count": 4, "max_batch_size": 16}'

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        return tokens_for(self.text)


class SaltStripped(FakeReplica):
    """Class 6: a proxy in front of the replica drops `cache_salt`, so requests of different runs share
    their blocks (and a cold request can load what an earlier run stored)."""

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return super().complete({key: value for key, value in body.items() if key != "cache_salt"})


class LyingCachedTokens(FakeReplica):
    """A neighbour of class 4: the warm answer claims the expected cached tokens while the replica loads
    nothing (its counters stay flat)."""

    claim = 128

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        usage = payload["usage"]
        if (
            "prompt_tokens_details" in usage
            and not admission.loaded
            and usage["prompt_tokens_details"]["cached_tokens"] == 0
        ):
            prompt = usage["prompt_tokens"]
            usage["prompt_tokens_details"] = {"cached_tokens": min(self.claim, prompt)}
        return payload


class DraftsWithoutDrafting(FakeReplica):
    """A neighbour of class 4: answers report speculative decoding while the drafter never runs (the
    Eagle counters stay flat)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec_decode_runs = False

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        payload["metrics"] = {
            "speculative_decoding": {
                "mean_acceptance_length": 2.0,
                "draft_acceptance_rate": 1 / 3,
                "acceptance_histogram": [0, 4, 0, 0],
                "num_spec_steps": 4,
                "num_accepted_draft_tokens": 4,
                "num_draft_tokens": 12,
                "num_spec_tokens": 3,
            }
        }
        return payload


class ColdClaimsCached(FakeReplica):
    """A neighbour of class 6: every answer reports cached prompt tokens, the cold one too."""

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        usage = payload["usage"]
        if "prompt_tokens_details" in usage:
            usage["prompt_tokens_details"] = {
                "cached_tokens": max(usage["prompt_tokens_details"]["cached_tokens"], 64)
            }
        return payload


class HugeNumbers(FakeReplica):
    """Absurd per-request numbers: cached tokens beyond any prompt."""

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        payload["usage"]["prompt_tokens_details"] = {"cached_tokens": 10**15}
        return payload


class NanLogprobs(FakeReplica):
    """NaN logprobs on a loaded answer (garbage KV): JSON's NaN, which Python's json writes."""

    def shape_tokens(self, tokens: list[Token], *, admission: Admission, body: dict[str, Any]) -> list[Token]:
        if not admission.loaded:
            return tokens
        return [
            replace(token, logprob=float("nan")) if index == 1 else token
            for index, token in enumerate(tokens)
        ]


class ShortTopLists(FakeReplica):
    """A neighbour of class 2: a loaded answer's top lists hold 3 entries where 5 were asked (a proxy
    that trims them): the tokens it leaves out have no bound."""

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        choice = payload["choices"][0]
        if admission.loaded and "logprobs" in choice:
            for entry in choice["logprobs"]["content"]:
                entry["top_logprobs"] = entry["top_logprobs"][:3]
        return payload


class StripsLogprobs(FakeReplica):
    """A proxy that strips logprobs from loaded answers only (one side has them, the other not)."""

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        if admission.loaded:
            payload = copy.deepcopy(payload)
            payload["choices"][0].pop("logprobs", None)
        return payload


class DropsUsage(FakeReplica):
    """A proxy that drops `usage` from every answer."""

    def shape_payload(self, payload: dict[str, Any], *, admission: Admission) -> dict[str, Any]:
        payload.pop("usage", None)
        return payload
