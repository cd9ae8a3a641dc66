"""A CanaryResult for people (a table plus the reasons) and for programs (JSON)."""

from __future__ import annotations

from mooncake_operator.canary.models import CanaryResult, ChatAnswer, PairResult, Verdict

_COLUMNS = [
    "PAIR",
    "REQUEST",
    "WRITER -> READER",
    "VERDICT",
    "DIVERGENCE",
    "DRIFT",
    "PROMPT",
    "EXT HIT",
    "EXPECTED",
    "PROOF",
    "LOAD_GET",
    "COLD s",
    "WARM s",
]


def render_json(result: CanaryResult) -> str:
    return result.model_dump_json(indent=2)


def render_table(result: CanaryResult) -> str:
    lines = [
        f"canary {result.run_id}: {result.verdict.value} — {result.reason}",
        f"expectations: {_expectations_line(result)}",
        f"expected hit: {_expected_hit_line(result)}",
        "",
    ]
    rows = [_COLUMNS] + [_row(pair) for pair in result.pairs]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_COLUMNS))]
    lines += [_line(row, widths) for row in rows]
    for pair in result.pairs:
        lines += _details(pair)
    lines += [f"warning: {warning}" for warning in result.warnings]
    cost = result.cost
    lines.append(
        f"cost: {cost.chat_requests} chat requests ({len(result.requests)} per pair: "
        f"{', '.join(result.requests)}), {cost.prompt_tokens} prompt + {cost.completion_tokens} completion "
        f"tokens, {cost.metrics_reads} reader and {cost.writer_metrics_reads} writer metrics reads, "
        f"{cost.detokenize_requests} detokenize, {cost.put_wait_s:.3f} s waiting for puts; comparison "
        f"{_comparison_line(result)}"
    )
    lines.append(
        f"wall {result.wall_s:.3f} s, of which waiting on replicas {result.request_latency_s:.3f} s; "
        f"exit {result.exit_code}"
    )
    return "\n".join(lines) + "\n"


def _expectations_line(result: CanaryResult) -> str:
    if not result.expectations:
        return "off (content checks disabled)"
    return "; ".join(result.expectations)


def _expected_hit_line(result: CanaryResult) -> str:
    expected = sorted({pair.expected_external_hit_tokens or 0 for pair in result.pairs} - {0})
    if not expected:
        return "any rise of the reader's external hit counter (--block-size [--eagle] demands the exact hit)"
    values = ", ".join(str(value) for value in expected)
    if result.block_size is None:
        return f"{values} tokens"
    return f"{values} tokens (block size {result.block_size}{', Eagle' if result.eagle else ''})"


def _line(cells: list[str], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def _row(pair: PairResult) -> list[str]:
    return [
        str(pair.index),
        pair.request_name,
        f"{pair.writer} -> {pair.reader}",
        pair.verdict.value,
        _divergence(pair),
        _drift(pair),
        _number(pair.prompt_tokens),
        _number(pair.external_hit_tokens),
        _number(pair.expected_external_hit_tokens) if pair.expected_external_hit_tokens else "any",
        pair.hit_evidence or "-",
        _number(pair.load_get_keys),
        _latency(pair.cold),
        _latency(pair.warm),
    ]


def _details(pair: PairResult) -> list[str]:
    if pair.verdict is Verdict.PASSED and not pair.notes:
        return []
    lines = ["", f"pair {pair.index} ({pair.verdict.value}), cache_salt {pair.cache_salt}:"]
    lines += [f"  - {reason}" for reason in pair.reasons]
    lines += [f"  note: {note}" for note in pair.notes]
    if pair.divergence is not None:
        lines.append(f"  divergence: {pair.divergence.describe()}")
    if pair.put_wait is not None:
        lines.append(f"  writer's puts: {pair.put_wait.describe()}")
    if pair.mismatch is not None and pair.cold is not None and pair.warm is not None:
        for role, answer in (("cold", pair.cold), ("warm", pair.warm)):
            if answer.reasoning is not None:
                lines.append(f"  {role} reasoning: {answer.reasoning!r}")
            lines.append(f"  {role} answer: {answer.text!r}")
    return lines


def _comparison_line(result: CanaryResult) -> str:
    comparison = result.comparison
    if comparison.mode.value == "exact":
        return f"exact (top-{comparison.top_k} by token id, drift <= {comparison.max_drift_nats:g} nat)"
    return (
        f"logprobs (top-{comparison.top_k} by token id, tie gap <= {comparison.max_tie_gap_nats:g} nat, "
        f"drift <= {comparison.max_drift_nats:g} nat)"
    )


def _divergence(pair: PairResult) -> str:
    """`-`: identical tokens; else its kind at its token, with the larger gap when both were seen."""
    divergence = pair.divergence
    if divergence is None:
        return "-"
    gaps = [gap for gap in (divergence.cold_gap_nats, divergence.warm_gap_nats) if gap is not None]
    gap = f" gap {max(gaps):.3f}" if len(gaps) == 2 else ""
    return f"{divergence.kind.value}@{divergence.position}{gap}"


def _drift(pair: PairResult) -> str:
    """The largest cold-versus-warm logprob change over the shared positions; `-`: not compared."""
    evidence = pair.logprob_evidence
    if evidence is None or evidence.max_drift_nats is None:
        return "-"
    return f"{'>=' if evidence.drift_bounded else ''}{evidence.max_drift_nats:.3g}"


def _number(value: int | None) -> str:
    return "-" if value is None else str(value)


def _latency(answer: ChatAnswer | None) -> str:
    return "-" if answer is None else f"{answer.latency_s:.3f}"
