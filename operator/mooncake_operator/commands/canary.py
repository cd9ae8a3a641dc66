"""`mooncake-operator canary`: prove on running replicas that a warm answer equals the cold one."""

from __future__ import annotations

import argparse
import asyncio
import sys
import traceback
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from mooncake_operator import safe_yaml
from mooncake_operator.api import describe_validation_error
from mooncake_operator.canary import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_CHAT_BODY_BYTES,
    DEFAULT_MAX_METRICS_BODY_BYTES,
    CanaryConfig,
    ExitCode,
    Expectation,
    customer_request,
    render_json,
    render_table,
    run_canary,
)
from mooncake_operator.commands.verdict_parser import VerdictCommandParser

DESCRIPTION = """\
For each ordered pair of replicas (writer, reader) the canary picks a fresh cache_salt, reads the
reader's Prometheus counters, sends the request to the writer (cold: it computes the prompt and
stores its KV blocks), sends the identical request to the reader (warm: it should load the prefix
from the shared store), and reads the reader's counters again.

A pair passes only when both answers are HTTP 200 chat completions, the warm answer equals the cold
one exactly, every expectation holds on both, and the reader's vllm:external_prefix_cache_hits_total
rose (by the expected hit, with --block-size). No rise means the warm path never ran: Inconclusive.

Default request: the customer's deployment-record chat (temperature 0). Default expectations: one
JSON object holding us-west, 4 and 16, none of us-east, 2 and 8, nothing before it.
"""

EPILOG = """\
exit status: 0 passed, 1 failed, 2 inconclusive, 3 usage or environment error (nothing was judged:
bad arguments or input files, a replica that cannot be reached), 70 internal error (a defect of
mooncake-operator; the traceback follows).

limits: each chat body is read up to --max-chat-bytes (4 MiB), each metrics page up to
--max-metrics-bytes (16 MiB), decoded size; a larger body is Inconclusive, never read further.

examples:
  mooncake-operator canary --replica http://10.0.0.21:8000 --replica http://10.0.0.22:8000 \\
      --block-size 16 --eagle
  mooncake-operator canary --replica http://a:8000 --replica http://b:8000 --model my-model \\
      --request chat.json --expect expect.yaml --json

expectations file (YAML or JSON), a list of checks:
  - kind: json_object_only
  - kind: json_values_include      # the object's values, as a multiset, hold these
    values: [us-west, 4, 16]
  - kind: json_values_exclude
    values: [us-east, 2, 8]
  - kind: json_field_equals        # a key named like "replica" (any case/punctuation) equals 4
    field: replica
    value: 4
  - kind: contains                 # or not_contains; case_sensitive: false by default
    text: us-west
"""

_EXPECTATIONS = TypeAdapter(list[Expectation])


class UsageError(Exception):
    """Input the canary cannot run with; the message says what to change."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "canary",
        help="prove that answers from prefixes loaded from the store equal cold answers",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # argparse has no per-subcommand parser class; this one only changes how usage errors exit.
    parser.__class__ = VerdictCommandParser
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.21:8000 (twice or more; order sets the ring)",
    )
    parser.add_argument(
        "--request",
        type=Path,
        metavar="FILE",
        help="chat completion body, JSON or YAML (default: customer's)",
    )
    parser.add_argument("--model", metavar="NAME", help="replace the request's model (the served model name)")
    content = parser.add_mutually_exclusive_group()
    content.add_argument("--expect", type=Path, metavar="FILE", help="expectations, YAML or JSON (see below)")
    content.add_argument(
        "--no-expect", action="store_true", help="content checks off; answers must still be equal"
    )
    parser.add_argument(
        "--pairs",
        choices=("ring", "first"),
        default="ring",
        help="ring: every replica writes for the next (default); first: replica 1 -> replica 2 only",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="deadline per chat request (default 120)"
    )
    parser.add_argument(
        "--metrics-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="deadline per metrics read (default 10)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        metavar="S",
        help=f"deadline per TCP connect, retried past it (default {DEFAULT_CONNECT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-chat-bytes",
        type=int,
        default=DEFAULT_MAX_CHAT_BODY_BYTES,
        metavar="N",
        help=f"cap on one chat answer's body, decoded (default {DEFAULT_MAX_CHAT_BODY_BYTES})",
    )
    parser.add_argument(
        "--max-metrics-bytes",
        type=int,
        default=DEFAULT_MAX_METRICS_BODY_BYTES,
        metavar="N",
        help=f"cap on one metrics page, decoded (default {DEFAULT_MAX_METRICS_BODY_BYTES})",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=3,
        metavar="N",
        help="retries of a refused connection, with backoff (3)",
    )
    hit = parser.add_mutually_exclusive_group()
    hit.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="the replicas' --block-size: demand the exact external hit the prompt should give",
    )
    hit.add_argument("--expected-hit", type=int, metavar="TOKENS", help="demand exactly this external hit")
    parser.add_argument(
        "--eagle", action="store_true", help="with --block-size: the replicas run Eagle speculative decoding"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        result = asyncio.run(run_canary(config))
        output = render_json(result) + "\n" if args.json else render_table(result)
    except UsageError as error:
        print(f"mooncake-operator canary: {error}", file=sys.stderr)
        return ExitCode.USAGE_OR_ENVIRONMENT
    except Exception:
        # Exit 1 means Failed (a finding about the replicas); a defect of ours must not read as one.
        print(
            "mooncake-operator canary: internal error (a defect of mooncake-operator, not a verdict "
            "about the replicas); please report it with this traceback:\n" + traceback.format_exc(),
            file=sys.stderr,
        )
        return ExitCode.INTERNAL_ERROR
    sys.stdout.write(output)
    return result.exit_code


def build_config(args: argparse.Namespace) -> CanaryConfig:
    """The CanaryConfig the arguments describe; UsageError with every problem otherwise."""
    if len(args.replica) < 2:
        raise UsageError("give at least two --replica URLs: one writes the prefix, another reads it")
    request = _load_request(args.request) if args.request else customer_request()
    if args.model:
        request["model"] = args.model
    options: dict[str, Any] = {
        "replicas": args.replica,
        "request": request,
        "pairs": args.pairs,
        "request_timeout_s": args.timeout,
        "metrics_timeout_s": args.metrics_timeout,
        "connect_timeout_s": args.connect_timeout,
        "max_chat_body_bytes": args.max_chat_bytes,
        "max_metrics_body_bytes": args.max_metrics_bytes,
        "connect_retries": args.retries,
        "expected_external_hit_tokens": args.expected_hit,
        "block_size": args.block_size,
        "eagle": args.eagle,
    }
    if args.no_expect:
        options["expectations"] = []
    elif args.expect:
        options["expectations"] = _load_expectations(args.expect)
    try:
        return CanaryConfig(**options)
    except ValidationError as error:
        raise UsageError("; ".join(describe_validation_error(error))) from None


def _load_request(path: Path) -> dict[str, Any]:
    document = _load_document(path)
    if not isinstance(document, dict):
        raise UsageError(f"{path}: the request must be a JSON/YAML object (a chat completion body)")
    return document


def _load_expectations(path: Path) -> list[Expectation]:
    document = _load_document(path)
    if isinstance(document, dict) and "expectations" in document:
        document = document["expectations"]
    try:
        return _EXPECTATIONS.validate_python(document)
    except ValidationError as error:
        raise UsageError(f"{path}: {'; '.join(describe_validation_error(error))}") from None


def _load_document(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        return safe_yaml.load(text)  # JSON is YAML too
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is neither JSON nor YAML: {error}") from None
