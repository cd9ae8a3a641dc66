"""`mooncake-operator run`: the kopf operator that reconciles MooncakeServing resources."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import kopf
from kopf._core.engines.peering import Identity  # the type of kopf.run's identity (not re-exported)

from mooncake_operator import exit_codes
from mooncake_operator.build.network_policy import REPLICA_INGRESS_DEFAULTS
from mooncake_operator.cli.parser import add_allow_flags
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeConfigError
from mooncake_operator.runtime.handlers import build_registry
from mooncake_operator.runtime.lease import (
    MAX_LEASE_DURATION_SECONDS,
    MIN_LEASE_DURATION_SECONDS,
    LeaderElector,
    LeadershipLost,
    LeaseSettings,
    default_identity,
)
from mooncake_operator.runtime.settings import (
    OperatorSettings,
    SettingsError,
    load_replica_endpoints,
)

logger = logging.getLogger("mooncake_operator.run")

DESCRIPTION = """\
Reconcile MooncakeServing resources: apply the store master, the store config, the vLLM replicas and their
Services with server-side apply; wait until the master and every replica are ready; prove with the warm/cold
canary that answers computed from prefixes loaded from the store equal cold ones; report it all in status.
See docs/operator.md for the RBAC it needs, its status, metrics and the Hold/Rollback semantics.
"""


def mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def register(subparsers: Any) -> None:
    # Every default is OperatorSettings' (or LeaseSettings'): the flags restate none of them.
    defaults, lease_defaults = OperatorSettings(), LeaseSettings(namespace="")
    parser = subparsers.add_parser(
        "run",
        help="run the operator (kopf)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--kubeconfig", type=Path, metavar="FILE", help="default: in-cluster, else $KUBECONFIG"
    )
    parser.add_argument("--context", metavar="NAME", help="kubeconfig context (default: its current one)")
    parser.add_argument(
        "--liveness-host",
        default=defaults.liveness_host,
        metavar="HOST",
        help="address of /healthz (default: %(default)s)",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=defaults.liveness_port,
        metavar="PORT",
        help="/healthz port (default: %(default)s; 0 disables)",
    )
    parser.add_argument(
        "--metrics-host",
        default=defaults.metrics_host,
        metavar="HOST",
        help="address of /metrics (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        metavar="PORT",
        help="/metrics port (default: %(default)s; 0 disables)",
    )
    parser.add_argument(
        "--replica-endpoints",
        type=Path,
        metavar="FILE",
        help='YAML map "<namespace>/<name>": [url, ...] overriding the per-replica DNS URLs',
    )
    parser.add_argument(
        "--master-endpoints",
        type=Path,
        metavar="FILE",
        help='YAML map "<namespace>/<name>": [url, ...] overriding the HA masters\' admin URLs (by ordinal)',
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=defaults.resync_seconds,
        metavar="S",
        help="re-check every resource this often even without a change (default: %(default)g; changes to a "
        "resource, its children and pods trigger a reconcile at once through watches)",
    )
    parser.add_argument(
        "--retry-delay-seconds",
        type=float,
        default=defaults.retry_delay_seconds,
        metavar="S",
        help="look again this soon while waiting (readiness, a leading HA master, a rollback) and after the "
        "API server refused or did not answer (default: %(default)g)",
    )
    parser.add_argument(
        "--max-concurrent-canaries",
        type=int,
        default=defaults.max_concurrent_canaries,
        metavar="N",
        help="canaries running at once across all resources (default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrent-canaries-per-namespace",
        type=int,
        default=defaults.max_concurrent_canaries_per_namespace,
        metavar="N",
        help="of those, at most N for the resources of one namespace, so one tenant cannot hold every slot "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--canary-max-timeout-seconds",
        type=int,
        default=defaults.canary_max_timeout_seconds,
        metavar="S",
        help="ceiling on spec.canary.timeoutSeconds, one request's timeout (default: %(default)s)",
    )
    parser.add_argument(
        "--canary-run-deadline-seconds",
        type=float,
        default=defaults.canary_run_deadline_seconds,
        metavar="S",
        help="a canary run not finished after S seconds is ended as Inconclusive and its slot freed "
        "(default: %(default)g)",
    )
    add_allow_flags(parser)
    parser.add_argument(
        "--replica-ingress-default",
        choices=REPLICA_INGRESS_DEFAULTS,
        default=defaults.replica_ingress_default,
        help="who may call the replicas' HTTP port of a resource that lists no "
        "spec.networkPolicy.clients: anyone, or (listed-clients) only the operator until it lists them "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--operator-namespace",
        metavar="NS",
        help="the namespace this operator's pods run in: the resources' NetworkPolicies admit the operator "
        f"from there only (default: $POD_NAMESPACE, else {defaults.operator_namespace}; the chart passes "
        "its release namespace)",
    )
    parser.add_argument(
        "--canary-max-chat-body-bytes",
        type=int,
        default=defaults.canary_max_chat_body_bytes,
        metavar="BYTES",
        help="ceiling on spec.canary.maxChatBodyBytes: a resource asking for more gets this cap, so no "
        "tenant sizes the operator's memory "
        f"(default: %(default)s, {mib(defaults.canary_max_chat_body_bytes)})",
    )
    parser.add_argument(
        "--canary-max-metrics-body-bytes",
        type=int,
        default=defaults.canary_max_metrics_body_bytes,
        metavar="BYTES",
        help="ceiling on spec.canary.maxMetricsBodyBytes "
        f"(default: %(default)s, {mib(defaults.canary_max_metrics_body_bytes)})",
    )
    parser.add_argument(
        "--leader-check-seconds",
        type=float,
        default=defaults.leader_check_seconds,
        metavar="S",
        help="ask highly available masters which one leads at least this often (default: %(default)g; a "
        "failover need not change any pod, so no watch reports it)",
    )
    parser.add_argument(
        "--inconclusive-retry-seconds",
        type=float,
        default=defaults.inconclusive_retry_seconds,
        metavar="S",
        help="run the canary again this long after an Inconclusive run (default: %(default)g)",
    )
    parser.add_argument(
        "--request-timeout-seconds",
        type=float,
        default=defaults.request_timeout_seconds,
        metavar="S",
        help="timeout of one API request (default: %(default)g)",
    )
    parser.add_argument(
        "--watch-timeout-seconds",
        type=float,
        default=defaults.watch_timeout_seconds,
        metavar="S",
        help="server-side timeout of a watch; the client gives up 30 s later and reconnects "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take a coordination.k8s.io Lease before reconciling, so only one operator process acts "
        "(default: on)",
    )
    parser.add_argument(
        "--lease-namespace",
        metavar="NS",
        help="namespace of the Lease (default: $POD_NAMESPACE, else the kubeconfig's, else default)",
    )
    parser.add_argument(
        "--lease-name",
        default=lease_defaults.name,
        metavar="NAME",
        help="name of the Lease (default: %(default)s)",
    )
    parser.add_argument(
        "--lease-duration-seconds",
        type=int,
        default=lease_defaults.duration_seconds,
        metavar="S",
        help="the Lease's duration (default: %(default)s). The leader renews it every "
        "S/3; when it could not renew for 2S/3 (the API server unreachable that long) it exits 1, before "
        "the Lease can expire for a standby, and the kubelet restarts it. It rides out an API server outage "
        "shorter than S/3 whenever that starts: set S to three times the longest outage you expect (a "
        "single API server's restart, a control-plane upgrade). The cost: a leader that dies without "
        "releasing the Lease keeps other pods (a standby, a replacement on another node) waiting up to S. "
        f"From {MIN_LEASE_DURATION_SECONDS} (shorter renewal periods leave no room for a slow answer) to "
        f"{MAX_LEASE_DURATION_SECONDS}",
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    verbosity.add_argument("--debug", action="store_true", help="log at DEBUG (default: INFO)")
    parser.set_defaults(func=run)


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    endpoints = load_replica_endpoints(args.replica_endpoints) if args.replica_endpoints else {}
    masters = load_replica_endpoints(args.master_endpoints) if args.master_endpoints else {}
    return OperatorSettings(
        namespaces=tuple(args.namespace),
        kubeconfig=args.kubeconfig,
        context=args.context,
        liveness_host=args.liveness_host,
        liveness_port=args.liveness_port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        replica_endpoints=endpoints,
        master_endpoints=masters,
        resync_seconds=args.resync_seconds,
        max_concurrent_canaries=args.max_concurrent_canaries,
        max_concurrent_canaries_per_namespace=args.max_concurrent_canaries_per_namespace,
        canary_max_timeout_seconds=args.canary_max_timeout_seconds,
        canary_run_deadline_seconds=args.canary_run_deadline_seconds,
        allow_privileged_engines=args.allow_privileged_engines,
        allow_host_network=args.allow_host_network,
        replica_ingress_default=args.replica_ingress_default,
        leader_check_seconds=args.leader_check_seconds,
        retry_delay_seconds=args.retry_delay_seconds,
        inconclusive_retry_seconds=args.inconclusive_retry_seconds,
        request_timeout_seconds=args.request_timeout_seconds,
        watch_timeout_seconds=args.watch_timeout_seconds,
        operator_namespace=args.operator_namespace
        or os.environ.get("POD_NAMESPACE")
        or OperatorSettings.operator_namespace,
        canary_max_chat_body_bytes=args.canary_max_chat_body_bytes,
        canary_max_metrics_body_bytes=args.canary_max_metrics_body_bytes,
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
        settings.kube_config()  # fail now, with the reason, rather than inside kopf's login loop
        lease = lease_settings_from(args, settings)
    except (SettingsError, KubeConfigError) as error:
        print(f"mooncake-operator run: {error}", file=sys.stderr)
        return exit_codes.USAGE
    kopf.configure(debug=args.debug, quiet=args.quiet)
    # One INFO line per API request (httpx's default) buries the operator's own lines.
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.debug else logging.WARNING)
    # kopf logs "Handler ... succeeded" at INFO for every MooncakeServing event its watch hands over.
    logging.getLogger("kopf.objects").setLevel(logging.DEBUG if args.debug else logging.WARNING)
    if not args.leader_election:
        kopf.run(
            registry=build_registry(settings),
            standalone=True,
            # kopf would ask getpass for the user name: the image's uid has no passwd entry.
            identity=Identity(default_identity()),
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            liveness_endpoint=settings.liveness_endpoint,
        )
        return 0
    return asyncio.run(run_as_leader(settings, lease))


def lease_settings_from(args: argparse.Namespace, settings: OperatorSettings) -> LeaseSettings:
    namespace = (
        args.lease_namespace
        or os.environ.get("POD_NAMESPACE")
        or settings.kube_config().namespace
        or "default"
    )
    return LeaseSettings(
        namespace=namespace, name=args.lease_name, duration_seconds=args.lease_duration_seconds
    )


def exit_now(status: int) -> None:
    """Ends the process at once, without waiting for tasks that ignore cancellation (a handler still
    running would act without the Lease)."""
    os._exit(status)


async def run_as_leader(settings: OperatorSettings, lease: LeaseSettings) -> int:
    """Wait for the Lease (answering liveness probes meanwhile), then run kopf while renewing it."""
    async with KubeClient(settings.kube_config(), timeout=settings.request_timeout_seconds) as kube:
        elector = LeaderElector(kube, lease)
        async with _standby_liveness(settings):
            await elector.acquire()
        stop = asyncio.Event()
        operator = asyncio.create_task(
            kopf.operator(
                registry=build_registry(settings),
                standalone=True,
                # kopf would ask getpass for the user name: the image's uid has no passwd entry.
                identity=Identity(elector.identity),
                clusterwide=not settings.namespaces,
                namespaces=list(settings.namespaces),
                liveness_endpoint=settings.liveness_endpoint,
                stop_flag=stop,
            )
        )
        keeper = asyncio.create_task(elector.keep())
        done, _ = await asyncio.wait({operator, keeper}, return_when=asyncio.FIRST_COMPLETED)
        if keeper in done:
            error = keeper.exception()
            logger.error("stopping: %s", error if isinstance(error, LeadershipLost) else repr(error))
            stop.set()
            # What is left of the Lease is the time to stop in: after it another process may take it.
            margin = lease.duration_seconds - lease.renew_deadline_seconds
            await asyncio.wait({operator}, timeout=max(margin - 1.0, 0.5))
            if not operator.done():
                logger.error(
                    "kopf did not stop within %.0f s: exiting now, before another process may take the Lease",
                    margin,
                )
                logging.shutdown()
                exit_now(1)
            return 1
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await elector.release()
        operator.result()
        return 0


@contextlib.asynccontextmanager
async def _standby_liveness(settings: OperatorSettings) -> Any:
    """A standby is alive: answer the liveness probe until kopf serves it (else it would be restarted)."""
    if not settings.liveness_port:
        yield
        return

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nstandby\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, settings.liveness_host, settings.liveness_port)
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()
