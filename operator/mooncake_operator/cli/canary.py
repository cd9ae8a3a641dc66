"""`mooncake-operator canary`: prove on running replicas that a warm answer equals the cold one."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mooncake_operator import exit_codes
from mooncake_operator.canary.defaults import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_CHAT_BODY_BYTES,
    DEFAULT_MAX_DRIFT_NATS,
    DEFAULT_MAX_METRICS_BODY_BYTES,
    DEFAULT_MAX_TIE_GAP_NATS,
    DEFAULT_PUT_WAIT_S,
    DEFAULT_TOP_K,
)
from mooncake_operator.cli.parser import VerdictCommandParser

# Only what `canary --help` needs is imported here (it starts in ~0.1 s of CPU); each path imports its
# own modules when it runs: the canary and its models (pydantic, httpx) for --replica, and the API
# models, the renderer and the API client on top for --resource.
if TYPE_CHECKING:
    from pydantic import ValidationError

    from mooncake_operator.canary.expectations import Expectation
    from mooncake_operator.canary.models import CanaryConfig, CanaryResult, SuiteEntry
    from mooncake_operator.cli.canary_resource import ResourceRef

DESCRIPTION = """\
For each ordered pair of replicas (writer, reader) the canary picks a fresh cache_salt, reads the
writer's Prometheus counters, sends the request to the writer (cold: it computes the prompt and
stores its KV blocks), waits (--put-wait) until the writer reports store puts covering the prompt,
reads the reader's counters, sends the identical request to the reader (warm: it should load the
prefix from the shared store), and reads the reader's counters again.

A pair passes only when both answers are HTTP 200 chat completions, the warm answer's token ids equal
the cold one's or part from them at a benign near tie, with the same distributions at every shared
position and the same text up to the divergence (both answers' logprobs by token id decide;
reported), every expectation holds on both, the cold answer was computed cold, and the warm one was
loaded from the store: by its own usage.prompt_tokens_details.cached_tokens (vLLM's
--enable-prompt-tokens-details; else the reader's vllm:external_prefix_cache_hits_total, when the
reader served nothing else meanwhile), covering the expected hit with --block-size, without failed
store loads, and with --eagle drafting (metrics.speculative_decoding, else the counters). What is not
proven is Inconclusive, with its cause. With --block-size each pair also runs the default
block-boundary suite (prompts ending on, one past and one short of a block boundary, and one of many
blocks, padded with the replicas' own /tokenize); --suite FILE runs yours, --no-suite none.

Default request: the reference deployment's deployment-record chat (temperature 0). Default expectations: one
JSON object holding us-west, 4 and 16, none of us-east, 2 and 8, nothing before it.

--resource [NAMESPACE/]NAME reads the MooncakeServing from the API (needs `get` on
mooncakeservings.serving.mooncake-operator.dev) and proves its serving replica set
(status.rollout.servingSet, else NAME-replica) with the operator's own config. Only pods that set's
StatefulSet created are dialled (controller references, UIDs checked; needs `get` on
statefulsets.apps and `list` on pods): inside the cluster at each pod's IP, outside it (a kubeconfig,
not a pod's service account) through the API server's pods proxy, which needs `get` and `create` on
pods/proxy in that namespace.
Request, expectations, pairs, timeout, block size and Eagle all come from the spec, and the verdict
is read as the operator reads it (spec.canary.requireExternalHit). The flags that say what to prove
(--request, --expect, --no-expect, --model, --block-size, --eagle, --expected-hit, --pairs,
--compare, --top-k, --max-tie-gap, --max-drift, --suite, --no-suite) are
refused with it; the timeouts, caps, --retries and --json apply.
"""

EPILOG = """\
exit status: 0 passed, 1 failed, 2 inconclusive, 3 usage or environment error (nothing was judged:
bad arguments or input files, a replica that cannot be reached; with --resource also a resource that
is missing, invalid or not readable (401/403/404), or an API server that cannot be reached), 70
internal error (a defect of mooncake-operator; the traceback follows).

limits: each chat body is read up to --max-chat-bytes (4 MiB), each metrics page up to
--max-metrics-bytes (16 MiB), decoded size; a larger body is Inconclusive, never read further.

examples:
  mooncake-operator canary --resource default/minimax-m25 --json     # as `helm test` runs it
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
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.21:8000 (twice or more; order sets the ring)",
    )
    target.add_argument(
        "--resource",
        metavar="[NAMESPACE/]NAME",
        help="prove a MooncakeServing's serving replicas as the operator does: the resource says what "
        "to prove (read from the API; namespace: -n, else the kubeconfig context's, in a pod the pod's, "
        "else default)",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="with --resource (default: in-cluster, else $KUBECONFIG)",
    )
    parser.add_argument(
        "--context", metavar="NAME", help="with --resource: kubeconfig context (default: its current one)"
    )
    parser.add_argument(
        "-n",
        "--namespace",
        metavar="NAMESPACE",
        help="with --resource NAME: its namespace (default: the kubeconfig context's, in a pod the pod's, "
        "else default)",
    )
    parser.add_argument(
        "--request",
        type=Path,
        metavar="FILE",
        help="chat completion body, JSON or YAML (default: the reference deployment's)",
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
        help="ring: every replica writes for the next (default); first: one pair only, the first --replica "
        "writes and the second reads",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="deadline per chat request (default 120; with --resource: its spec.canary.timeoutSeconds)",
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
        metavar="N",
        help=f"cap on one chat answer's body, decoded (default {DEFAULT_MAX_CHAT_BODY_BYTES}; with "
        "--resource: its spec.canary.maxChatBodyBytes when set)",
    )
    parser.add_argument(
        "--max-metrics-bytes",
        type=int,
        metavar="N",
        help=f"cap on one metrics page, decoded (default {DEFAULT_MAX_METRICS_BODY_BYTES}; with "
        "--resource: its spec.canary.maxMetricsBodyBytes when set)",
    )
    parser.add_argument(
        "--put-wait",
        type=float,
        metavar="S",
        help="after the cold answer, wait at most S seconds for the writer to report store puts covering "
        f"the prompt's full blocks before the warm request (default {DEFAULT_PUT_WAIT_S:g}; 0: not at all)",
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
    compare = parser.add_argument_group(
        "comparison", "how the warm answer is compared with the cold one (docs/canary.md)"
    )
    compare.add_argument(
        "--compare",
        choices=("logprobs", "exact"),
        help="logprobs (default): identical tokens pass, a first divergence is judged benign or not from "
        "both answers' logprobs; exact: equal answers only (batch-invariant kernels)",
    )
    compare.add_argument(
        "--top-k", type=int, metavar="K", help=f"top_logprobs asked per token (default {DEFAULT_TOP_K})"
    )
    compare.add_argument(
        "--max-tie-gap",
        type=float,
        metavar="NATS",
        help=f"largest gap of the two tokens of a benign divergence (default {DEFAULT_MAX_TIE_GAP_NATS:g})",
    )
    compare.add_argument(
        "--max-drift",
        type=float,
        metavar="NATS",
        help=f"largest drift of a shared token's logprob before it (default {DEFAULT_MAX_DRIFT_NATS:g})",
    )
    suite = parser.add_mutually_exclusive_group()
    suite.add_argument(
        "--suite",
        type=Path,
        metavar="FILE",
        help="more requests each pair runs, YAML or JSON: a list of {name, request, expectations}",
    )
    suite.add_argument(
        "--no-suite",
        action="store_true",
        help="only the request (default with --block-size: the block-boundary suite beside it)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as JSON instead of a table; a setup error (exit 3) or an internal error "
        '(exit 70) as {"error": {"kind": ..., "message": ...}, "exitCode": N}',
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress lines on stderr (by default one per step: which pair, which request, elapsed)",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        from mooncake_operator.canary.report import render_json, render_table

        result = asyncio.run(_prove(args))
        output = render_json(result) + "\n" if args.json else render_table(result)
    except UsageError as error:
        print(f"mooncake-operator canary: {error}", file=sys.stderr)
        return _error_exit(args, "setup", str(error), exit_codes.USAGE)
    except Exception:
        # Exit 1 means Failed (a finding about the replicas); a defect of ours must not read as one.
        print(
            "mooncake-operator canary: internal error (a defect of mooncake-operator, not a verdict "
            "about the replicas); please report it with this traceback:\n" + traceback.format_exc(),
            file=sys.stderr,
        )
        message = f"internal error: {traceback.format_exception_only(sys.exc_info()[1])[-1].strip()}"
        return _error_exit(args, "internal", message, exit_codes.INTERNAL_ERROR)
    sys.stdout.write(output)
    return result.exit_code


def _error_exit(args: argparse.Namespace, kind: str, message: str, code: int) -> int:
    """Under --json, stdout is JSON whatever happens: a caller parsing it (helm test logs, CI) gets the
    error as an object rather than nothing."""
    if args.json:
        error = {"error": {"kind": kind, "message": message}, "exitCode": code}
        sys.stdout.write(json.dumps(error, indent=2) + "\n")
    return code


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    if args.quiet:
        return None

    def tell(line: str) -> None:
        print(f"mooncake-operator canary: {line}", file=sys.stderr, flush=True)

    return tell


async def _prove(args: argparse.Namespace) -> CanaryResult:
    if args.resource is None:
        from mooncake_operator.canary.runner import run_canary

        return await run_canary(build_config(args), progress=_progress(args))
    refuse_what_flags(args)
    from mooncake_operator.cli.canary_proxy import ProxyAccessError
    from mooncake_operator.cli.canary_resource import ResourceError
    from mooncake_operator.kube.errors import KubeConfigError

    try:
        return await _prove_resource(args)
    except (ResourceError, ProxyAccessError) as error:
        raise UsageError(str(error)) from None
    except KubeConfigError as error:  # also an exec plugin that fails while a request is made
        raise UsageError(str(error)) from None
    except OSError as error:  # a CA, certificate or token file that cannot be read
        raise UsageError(f"API credentials: {error}") from None


async def _prove_resource(args: argparse.Namespace) -> CanaryResult:
    from mooncake_operator.canary.models import CanaryConfig
    from mooncake_operator.canary.runner import run_canary
    from mooncake_operator.cli.canary_proxy import check_proxy_access, proxy_client, proxy_urls
    from mooncake_operator.cli.canary_resource import (
        effective_result,
        fetch_replica_pods,
        fetch_serving,
        pod_urls,
        resource_canary,
    )
    from mooncake_operator.kube.client import KubeClient
    from mooncake_operator.kube.config import KubeConfig
    from mooncake_operator.kube.kinds import SERVING_KIND

    if args.kubeconfig is not None or args.context is not None:
        kube_config = KubeConfig.from_kubeconfig(args.kubeconfig, args.context)
    else:
        kube_config = KubeConfig.load_default()
    ref = resource_ref(args.resource, args.namespace, kube_config.namespace)
    async with KubeClient(kube_config, kinds=[SERVING_KIND]) as kube:
        resource = await fetch_serving(kube, ref)
        planned = resource_canary(resource)
        for note in planned.notes:
            print(f"mooncake-operator canary: note: {note}", file=sys.stderr)
        config = with_how_flags(planned.config, args)
        port = resource.spec.engine.port
        if kube_config.in_cluster_config:
            # Inside the cluster: the IP of each pod the resource's StatefulSet created (proven first).
            urls = pod_urls(await fetch_replica_pods(kube, resource, planned.serving_set), port)
            result = await run_canary(
                CanaryConfig(**{**dict(config), "replicas": urls}), progress=_progress(args)
            )
        else:
            await check_proxy_access(kube, ref.namespace)
            names = [pod.name for pod in await fetch_replica_pods(kube, resource, planned.serving_set)]
            urls = proxy_urls(kube_config.server, ref.namespace, names, port)
            print(
                "mooncake-operator canary: note: outside the cluster: reaching the replicas through the "
                f"API server's pods proxy ({', '.join(names)})",
                file=sys.stderr,
            )
            async with proxy_client(kube_config) as client:
                proxied = CanaryConfig(**{**dict(config), "replicas": urls})
                result = await run_canary(proxied, client=client, progress=_progress(args))
    # The operator's reading of the run (requireExternalHit), so exit 0 means what its status would.
    return effective_result(result, require_external_hit=planned.require_external_hit)


def resource_ref(text: str, namespace_flag: str | None, kube_namespace: str | None) -> ResourceRef:
    """--resource [NAMESPACE/]NAME with -n/--namespace, like kubectl: -n sets the namespace of a bare
    NAME; NAMESPACE/ and a different -n together are a usage error."""
    from mooncake_operator.cli.canary_resource import parse_ref

    ref = parse_ref(text, namespace_flag or kube_namespace)
    if namespace_flag and ref.namespace != namespace_flag:
        raise UsageError(f"--resource {text!r} names namespace {ref.namespace} but -n says {namespace_flag}")
    return ref


# Flags that say WHAT to prove: with --resource its spec says it (one source of truth, the operator's).
WHAT_FLAGS = (
    ("request", "--request"),
    ("expect", "--expect"),
    ("no_expect", "--no-expect"),
    ("model", "--model"),
    ("block_size", "--block-size"),
    ("eagle", "--eagle"),
    ("expected_hit", "--expected-hit"),
    ("pairs", "--pairs"),
    ("compare", "--compare"),
    ("top_k", "--top-k"),
    ("max_tie_gap", "--max-tie-gap"),
    ("max_drift", "--max-drift"),
    ("suite", "--suite"),
    ("no_suite", "--no-suite"),
)


def refuse_what_flags(args: argparse.Namespace) -> None:
    given = [flag for attribute, flag in WHAT_FLAGS if _given(getattr(args, attribute))]
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be given with --resource: the resource says what to prove "
            "(spec.model, spec.engine, spec.speculative, spec.canary)"
        )


def _given(value: object) -> bool:
    # Their defaults are None and False; by identity, so that --block-size 0 counts too (0 == False).
    return value is not None and value is not False


def how_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that say HOW patiently (timeouts, caps, retries) that were given; the others keep
    CanaryConfig's defaults, which the operator runs with (the spec has no metrics or connect timeout,
    nor retries)."""
    given = {
        "request_timeout_s": args.timeout,
        "metrics_timeout_s": args.metrics_timeout,
        "connect_timeout_s": args.connect_timeout,
        "max_chat_body_bytes": args.max_chat_bytes,
        "max_metrics_body_bytes": args.max_metrics_bytes,
        "connect_retries": args.retries,
        "put_wait_s": args.put_wait,
    }
    return {key: value for key, value in given.items() if value is not None}


def with_how_flags(config: CanaryConfig, args: argparse.Namespace) -> CanaryConfig:
    """The resource's config with the HOW flags given."""
    from pydantic import ValidationError

    from mooncake_operator.canary.models import CanaryConfig

    try:
        return CanaryConfig(**{**dict(config), **how_options(args)})
    except ValidationError as error:
        raise UsageError("; ".join(_problems(error))) from None


def build_config(args: argparse.Namespace) -> CanaryConfig:
    """The CanaryConfig the arguments describe; UsageError with every problem otherwise."""
    from pydantic import ValidationError

    from mooncake_operator.canary.models import CanaryConfig
    from mooncake_operator.canary.request import reference_request

    if args.kubeconfig is not None or args.context is not None:
        raise UsageError("--kubeconfig and --context only apply with --resource")
    if args.namespace is not None:
        raise UsageError("-n/--namespace only applies with --resource")
    if len(args.replica) < 2:
        raise UsageError("give at least two --replica URLs: one writes the prefix, another reads it")
    request = _load_request(args.request) if args.request else reference_request()
    if args.model:
        request["model"] = args.model
    options: dict[str, Any] = {
        "replicas": args.replica,
        "request": request,
        "expected_external_hit_tokens": args.expected_hit,
        "block_size": args.block_size,
        "eagle": args.eagle,
        **how_options(args),
    }
    if args.pairs is not None:
        options["pairs"] = args.pairs
    comparison = {
        key: value
        for key, value in (
            ("mode", args.compare),
            ("top_k", args.top_k),
            ("max_tie_gap_nats", args.max_tie_gap),
            ("max_drift_nats", args.max_drift),
        )
        if value is not None
    }
    options["comparison"] = comparison
    if args.suite is not None:
        options["suite"] = _load_suite(args.suite)
    elif not args.no_suite and args.block_size is not None:
        options["suite"] = "default"
    if args.no_expect:
        options["expectations"] = []
    elif args.expect:
        options["expectations"] = _load_expectations(args.expect)
    try:
        return CanaryConfig(**options)
    except ValidationError as error:
        raise UsageError("; ".join(_problems(error))) from None


def _load_request(path: Path) -> dict[str, Any]:
    document = _load_document(path)
    if not isinstance(document, dict):
        raise UsageError(f"{path}: the request must be a JSON/YAML object (a chat completion body)")
    return document


def _load_suite(path: Path) -> list[SuiteEntry]:
    from pydantic import TypeAdapter, ValidationError

    from mooncake_operator.canary.models import SuiteEntry

    document = _load_document(path)
    if isinstance(document, dict) and "suite" in document:
        document = document["suite"]
    try:
        return TypeAdapter(list[SuiteEntry]).validate_python(document)
    except ValidationError as error:
        raise UsageError(f"{path}: {'; '.join(_problems(error))}") from None


def _load_expectations(path: Path) -> list[Expectation]:
    from pydantic import TypeAdapter, ValidationError

    from mooncake_operator.canary.expectations import Expectation

    document = _load_document(path)
    if isinstance(document, dict) and "expectations" in document:
        document = document["expectations"]
    try:
        return TypeAdapter(list[Expectation]).validate_python(document)
    except ValidationError as error:
        raise UsageError(f"{path}: {'; '.join(_problems(error))}") from None


def _load_document(path: Path) -> object:
    import yaml

    from mooncake_operator import safe_yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        return safe_yaml.load(text, str(path))  # JSON is YAML too
    except yaml.YAMLError as error:
        where = safe_yaml.describe_error(error, str(path))
        raise UsageError(f"{path} is neither JSON nor YAML: {where}") from None


def _problems(error: ValidationError) -> list[str]:
    # mooncake_operator.api builds every API model on import (~0.3 s of CPU): only on an error.
    from mooncake_operator.api.base import describe_validation_error

    return describe_validation_error(error)
