"""How far the canary's logprob rule is from a wrong verdict, on real engines, over many salts.

    flock /tmp/heavy.lock .venv/bin/python bench/canary_numerics.py [--salts 20] [--deterministic-salts 2]
        [--bound 0.2] [--out FILE]

One sandbox (real mooncake_master, two real vLLM CPU replicas, Eagle-3 as the customer's). The default
suite (the customer's request + the four block-boundary requests, padded with the replicas' own
/tokenize) is built once; then, for each engine setting, one canary pair A -> B per salt runs every
suite request (a fresh salt each), judged by the canary's own rule (`canary.divergence`):

- buggy: the pre-fix coordinator. Per divergence, its margin to being called benign: how far the
  evidence lies beyond the thresholds (max of each side's tie gap minus max_tie_gap_nats and the drift
  minus max_drift_nats); "outside top-k" when a token is not in the other side's top list (no gap
  threshold makes that benign). Smallest margin over every salt and request reported.
- patched: the fixed coordinator. Largest drift: the largest |cold - warm| logprob over the tokens the
  two answers share (whole answer when equal, up to the divergence otherwise); and every divergence.
- patched + perturbed reader (--bound): replica B serves the target with logits moved by at most
  BOUND nats (sandbox/perturbed_model.py). Same numbers.
- buggy + perturbed reader: the corruption must still be called corruption.

A salt changes only the cache key (`cache_salt`), never the computation: on the CPU engines the patched
reader's tokens and logprobs are the same at every salt, so the two patched settings run
--deterministic-salts salts (default 2) and the report says whether those runs were identical (if not,
run them with --deterministic-salts 20); only the buggy reader's uninitialised block varies per salt.

Re-executes itself in a loopback-only network namespace. JSON on stdout, progress on stderr. With
--out FILE the report so far is also written there after every salt: a run stopped early (a salt costs
~100 s on the shared 2-core machine, so 20 salts x 4 settings take over two hours) keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mooncake_operator.canary.models import (
    CanaryResult,
    Comparison,
    Divergence,
    DivergenceKind,
    PairResult,
    SuiteEntry,
    TokenLogprob,
)
from mooncake_operator.canary.request import default_suite, suite_cost
from mooncake_operator.canary.runner import run_canary
from mooncake_sandbox import EngineMode, Sandbox, SandboxOptions, netns, prepare, start_sandbox

A, B = 0, 1


def margin_to_benign(divergence: Divergence, comparison: Comparison) -> float | None:
    """Nats beyond the benign thresholds (<= 0: benign); None when no gap threshold could make it benign."""
    if divergence.cold_gap_nats is None or divergence.warm_gap_nats is None:
        return None
    margins = [
        divergence.cold_gap_nats - comparison.max_tie_gap_nats,
        divergence.warm_gap_nats - comparison.max_tie_gap_nats,
    ]
    if divergence.max_drift_nats is not None:
        margins.append(divergence.max_drift_nats - comparison.max_drift_nats)
    return max(margins)


def shared_drift(cold: list[TokenLogprob] | None, warm: list[TokenLogprob] | None) -> float | None:
    """Largest |cold - warm| logprob over the leading tokens both answers share."""
    if not cold or not warm:
        return None
    drifts = []
    for a, b in zip(cold, warm, strict=False):
        if a.token != b.token:
            break
        drifts.append(abs(a.logprob - b.logprob))
    return max(drifts) if drifts else None


@dataclass
class Setting:
    name: str
    engine: EngineMode
    perturb_nats: float | None
    salts: int
    pairs: list[dict[str, Any]] = field(default_factory=list)
    # Per suite request: (tokens, logprobs) of the warm answer at each salt, to check determinism.
    answers: dict[str, set[str]] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def record(self, pair: PairResult, salt: int, comparison: Comparison) -> None:
        divergence = pair.divergence
        cold = pair.cold.logprobs if pair.cold else None
        warm = pair.warm.logprobs if pair.warm else None
        row: dict[str, Any] = {
            "salt": salt,
            "request": pair.request_name,
            "verdict": pair.verdict.value,
            "prompt_tokens": pair.prompt_tokens,
            "external_hit_tokens": pair.external_hit_tokens,
            "load_get_keys": pair.load_get_keys,
            "answers_equal": pair.answers_equal,
            "shared_drift_nats": shared_drift(cold, warm),
            "divergence": None,
        }
        if divergence is not None:
            row["divergence"] = {
                "kind": divergence.kind.value,
                "position": divergence.position,
                "cold_gap_nats": divergence.cold_gap_nats,
                "warm_gap_nats": divergence.warm_gap_nats,
                "drift_nats": divergence.max_drift_nats,
                "margin_to_benign_nats": margin_to_benign(divergence, comparison),
                "reasons": divergence.reasons,
            }
        self.pairs.append(row)
        self.answers.setdefault(pair.request_name, set()).add(
            json.dumps([(t.token, t.logprob) for t in warm or []])
        )
        self.verdicts[pair.verdict.value] = self.verdicts.get(pair.verdict.value, 0) + 1

    def summary(self) -> dict[str, Any]:
        divergences = [row["divergence"] for row in self.pairs if row["divergence"] is not None]
        corruption = [d for d in divergences if d["kind"] == DivergenceKind.CORRUPTION.value]
        benign = [d for d in divergences if d["kind"] == DivergenceKind.BENIGN.value]
        margins = [d["margin_to_benign_nats"] for d in corruption if d["margin_to_benign_nats"] is not None]
        drifts = [row["shared_drift_nats"] for row in self.pairs if row["shared_drift_nats"] is not None]
        gaps = [max(d["cold_gap_nats"], d["warm_gap_nats"]) for d in benign]
        by_request: dict[str, int] = {}
        for row in self.pairs:
            if row["divergence"] is not None:
                by_request[row["request"]] = by_request.get(row["request"], 0) + 1
        return {
            "engine": self.engine.value,
            "perturb_nats": self.perturb_nats,
            "pairs": len(self.pairs),
            "salts": self.salts,
            "same_answer_at_every_salt": all(len(seen) == 1 for seen in self.answers.values()),
            "verdicts": self.verdicts,
            "divergences": {"benign": len(benign), "corruption": len(corruption), "by_request": by_request},
            "corruption_outside_top_k": len(corruption) - len(margins),
            "smallest_margin_to_benign_nats": min(margins) if margins else None,
            "largest_shared_drift_nats": max(drifts) if drifts else None,
            "largest_benign_gap_nats": max(gaps) if gaps else None,
            "wall_s": round(self.wall_s, 1),
        }


async def configure(sandbox: Sandbox, engine: EngineMode, perturb_nats: float | None) -> None:
    # One restart of every replica that must change (a restart waits out the store's segment drop).
    stale = {r.index for r in sandbox.replicas if r.engine is not engine}
    if sandbox.replicas[B].perturb_nats != perturb_nats:
        stale.add(B)
    if stale:
        await sandbox.restart_replicas(sorted(stale), engine=engine, perturb_nats={B: perturb_nats})


async def run_setting(
    sandbox: Sandbox,
    setting: Setting,
    suite: list[SuiteEntry],
    checkpoint: Callable[[], None],
) -> None:
    await configure(sandbox, setting.engine, setting.perturb_nats)
    config = sandbox.canary_config(eagle=True).model_copy(update={"pairs": "first", "suite": suite})
    started = time.monotonic()
    salts = setting.salts
    for salt in range(salts):
        result: CanaryResult = await sandbox.guard(run_canary(config))
        for pair in result.pairs:
            setting.record(pair, salt, config.comparison)
        setting.wall_s = time.monotonic() - started
        print(f"{setting.name}: salt {salt + 1}/{salts}: {result.verdict.value}", file=sys.stderr, flush=True)
        checkpoint()


async def main_async(salts: int, deterministic_salts: int, bound: float, out: Path | None) -> dict[str, Any]:
    prepared = await asyncio.to_thread(
        prepare, tuple(EngineMode), log=lambda line: print(line, file=sys.stderr)
    )
    options = SandboxOptions(engine=EngineMode.PATCHED, speculative=True)
    async with start_sandbox(options, prepared=prepared) as sandbox:
        config = sandbox.canary_config(eagle=True)
        async with httpx.AsyncClient(trust_env=False) as client:
            built = await default_suite(
                client, sandbox.replica_urls[A], config.request, block_size=sandbox.block_size
            )
        suite = [SuiteEntry(name=item.name, request=item.request, expectations=None) for item in built[1:]]
        # The two headline numbers first (largest drift, smallest margin): a run stopped early has them.
        settings = [
            Setting("patched", EngineMode.PATCHED, None, deterministic_salts),
            Setting("buggy", EngineMode.BUGGY, None, salts),
            Setting("buggy + perturbed reader", EngineMode.BUGGY, bound, salts),
            Setting("patched + perturbed reader", EngineMode.PATCHED, bound, deterministic_salts),
        ]

        def report() -> dict[str, Any]:
            perturbed = sandbox.perturbed_targets.get(bound)
            return {
                "salts": salts,
                "deterministic_salts": deterministic_salts,
                "comparison": config.comparison.model_dump(),
                "block_size": sandbox.block_size,
                "suite": [
                    {
                        "name": item.name,
                        "prompt_tokens": item.prompt_tokens,
                        "max_tokens": item.request["max_tokens"],
                    }
                    for item in built
                ],
                "suite_cost_per_pair": suite_cost(built).__dict__,
                "perturbation": None if perturbed is None else perturbed.describe(),
                "settings": {setting.name: setting.summary() for setting in settings},
                "pairs": {setting.name: setting.pairs for setting in settings},
            }

        def checkpoint() -> None:
            if out is not None:
                out.write_text(json.dumps(report(), indent=2))

        for setting in settings:
            await run_setting(sandbox, setting, suite, checkpoint)
        return report()


def _bound(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 10):
        raise argparse.ArgumentTypeError(f"need a bound between 0 and 10 nats, got {text}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--salts", type=int, default=20, help="canary pairs per buggy setting (default 20)")
    parser.add_argument(
        "--deterministic-salts",
        type=int,
        default=2,
        help="canary pairs per patched setting (default 2: a salt changes the cache key only)",
    )
    parser.add_argument("--bound", type=_bound, default=0.2, help="the reader's perturbation bound, nats")
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="also write the report so far here after every salt"
    )
    parser.add_argument("--all-pairs", action="store_true", help="print every pair's row, not only summaries")
    args = parser.parse_args()
    if not netns.in_private_netns() and netns.namespaces_permitted():
        netns.exec_in_netns([sys.executable, *sys.argv])
    report = asyncio.run(main_async(args.salts, args.deterministic_salts, args.bound, args.out))
    if not args.all_pairs:
        report.pop("pairs")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
