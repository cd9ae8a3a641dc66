"""A small typed async client for the Kubernetes API: every request the operator makes itself.

kopf watches the MooncakeServings; this client lists and watches the children and pods for the watch
cache, applies children (server-side apply, one field manager), patches labels and status, posts events,
keeps the leader Lease and asks discovery which versions are served. It counts its requests so tests
and benchmarks can assert that a reconcile with nothing to change writes nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError, KubeTransportError
from mooncake_operator.kube.events import event_manifest
from mooncake_operator.kube.kinds import (
    KNOWN_KINDS,
    Manifest,
    ManifestList,
    ResourceKind,
    kinds_by_key,
    manifest_identity,
    resource_path,
)

APPLY_PATCH: Final = "application/apply-patch+yaml"
MERGE_PATCH: Final = "application/merge-patch+json"
_LIST_PAGE_SIZE: Final = 500
WATCH_READ_GRACE_SECONDS: Final = 30.0
MAX_IN_FLIGHT: Final = 32


READ_VERBS: Final = frozenset({"get", "list"})
# Not a write either: a watch reads a stream of changes (counted apart from reads).
STREAM_VERBS: Final = frozenset({"watch"})


@dataclass
class RequestCounts:
    """Requests made, by verb (get, list, watch, create, apply, patch, patch_status, delete).

    `writes` counts requests that may persist a change; dry runs are counted apart.
    """

    by_verb: Counter[str] = field(default_factory=Counter)
    dry_runs: int = 0

    @property
    def reads(self) -> int:
        return sum(n for verb, n in self.by_verb.items() if verb in READ_VERBS)

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.by_verb.items() if verb not in READ_VERBS | STREAM_VERBS)

    def snapshot(self) -> RequestCounts:
        return RequestCounts(by_verb=Counter(self.by_verb), dry_runs=self.dry_runs)

    def since(self, earlier: RequestCounts) -> RequestCounts:
        return RequestCounts(
            by_verb=self.by_verb - earlier.by_verb, dry_runs=self.dry_runs - earlier.dry_runs
        )


class KubeAuth(httpx.Auth):
    """Bearer token of a `KubeConfig` on every request. An exec plugin's token is fetched (cached) before
    each request; when the API server answers 401 to it, the plugin runs once more and the request is
    sent once more, as client-go does. A second 401 is the caller's answer."""

    def __init__(self, config: KubeConfig) -> None:
        self._config = config

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._config.current_token()  # static tokens only: exec plugins run in async_auth_flow
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token, _ = await self._config.bearer()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        plugin = self._config.exec_credentials
        if response.status_code == 401 and plugin is not None and token:
            fresh = await plugin.after_unauthorized(token)
            request.headers["Authorization"] = f"Bearer {fresh.token}"
            yield request


def _error_from(response: httpx.Response, config: KubeConfig | None = None) -> KubeApiError:
    try:
        body = response.json()
    except ValueError:
        body = None
    details = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        reason = str(body.get("reason") or response.reason_phrase)
        message = str(body.get("message") or response.text)
        details = body.get("details")
    else:
        reason, message = response.reason_phrase, response.text.strip() or "(empty body)"
    if response.status_code == 401 and config is not None and config.exec_credentials is not None:
        # KubeAuth has already run the plugin again after the first 401: say so, or users re-run by hand.
        command = config.exec_credentials.plugin.command
        message += f" (exec plugin {command} ran again after a first 401: its fresh token was refused too)"
    return KubeApiError(response.status_code, reason, message, details)


def _kind_and_namespace(obj: Mapping[str, Any]) -> tuple[str, str, str | None]:
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not (isinstance(api_version, str) and isinstance(kind, str)):
        raise ValueError(f"manifest needs apiVersion and kind; got {api_version!r} {kind!r}")
    return api_version, kind, (obj.get("metadata") or {}).get("namespace")


class KubeClient:
    """Async API client. Use as `async with KubeClient(config) as kube:` or call `aclose()`.

    `transport` lets tests inject an httpx transport; `kinds` are the custom kinds it serves besides the
    built-in ones (KNOWN_KINDS). `on_write`, when set, is called with the object each successful apply,
    patch or create returned (the operator's watch cache absorbs its own writes with it, so the next
    reconcile never reads something older).
    """

    def __init__(
        self,
        config: KubeConfig,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        kinds: Iterable[ResourceKind] = (),
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.config = config
        self.counts = RequestCounts()
        self.timeout = timeout
        self.on_write: Callable[[Manifest], None] | None = None
        # At most this many requests in flight (watches apart): with a thousand resources reconciling at
        # once, the rest wait here in a FIFO, not in httpx's connection pool, whose queue costs
        # O(waiting x connections) per finished request (measured: it saturated the operator's CPU).
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self.kinds_by_key = {**KNOWN_KINDS, **kinds_by_key(*kinds)}
        self._http = httpx.AsyncClient(
            base_url=config.server,
            verify=config.ssl_context(),
            auth=KubeAuth(config),
            # Requests wait for a slot in `_in_flight` (below), so the pool itself never queues.
            timeout=httpx.Timeout(timeout, pool=None),
            transport=transport,
            headers={"Accept": "application/json", "User-Agent": "mooncake-operator"},
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def kind(self, api_version: str, kind: str) -> ResourceKind:
        try:
            return self.kinds_by_key[(api_version, kind)]
        except KeyError:
            known = ", ".join(sorted(f"{v}/{k}" for v, k in self.kinds_by_key))
            raise ValueError(f"unknown kind {api_version}/{kind}; known: {known}") from None

    def _object_path(self, obj: Mapping[str, Any], subresource: str | None = None) -> str:
        api_version, kind, name, namespace = manifest_identity(obj)
        return resource_path(
            self.kind(api_version, kind), namespace=namespace, name=name, subresource=subresource
        )

    async def _request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        dry_run: bool = False,
    ) -> Manifest:
        query = dict(params or {})
        if dry_run:
            query["dryRun"] = "All"
            self.counts.dry_runs += 1
        else:
            self.counts.by_verb[verb] += 1
        content = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": content_type}
        try:
            async with self._in_flight:
                response = await self._http.request(
                    method, path, params=query, content=content, headers=headers
                )
        except httpx.HTTPError as error:
            raise KubeTransportError(f"{method} {path}: {error!r}") from error
        if response.is_error:
            raise _error_from(response, self.config)
        result: Manifest = response.json() if response.content else {}
        if self.on_write is not None and verb not in READ_VERBS and not dry_run and result.get("kind"):
            self.on_write(result)
        return result

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Manifest:
        path = resource_path(self.kind(api_version, kind), namespace=namespace, name=name)
        return await self._request("get", "GET", path)

    async def served_versions(self, group: str) -> list[str]:
        """The versions the API server serves of an API group (discovery), e.g. ["v1", "v1beta1"];
        [] when it does not serve the group at all."""
        try:
            found = await self._request("get", "GET", f"/apis/{group}")
        except KubeApiError as error:
            if error.not_found:
                return []
            raise
        return [str(entry.get("version")) for entry in found.get("versions") or []]

    async def get_or_none(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> Manifest | None:
        try:
            return await self.get(api_version, kind, name, namespace)
        except KubeApiError as error:
            if error.not_found:
                return None
            raise

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> ManifestList:
        """All matching objects (every page), each with its apiVersion and kind filled in."""
        items, _ = await self._list_pages(api_version, kind, namespace, label_selector, field_selector)
        return items

    async def list_snapshot(
        self, api_version: str, kind: str, namespace: str | None = None, *, label_selector: str | None = None
    ) -> tuple[ManifestList, str]:
        """All matching objects and the collection's resourceVersion, from which a watch continues."""
        return await self._list_pages(api_version, kind, namespace, label_selector, None)

    async def watch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        resource_version: str,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[Manifest]:
        """Watch events (`{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`) after
        `resource_version`, until the server ends the stream after `timeout_seconds`."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(timeout_seconds)),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        self.counts.by_verb["watch"] += 1
        # The server ends the stream; the client's read timeout only catches a server that went silent.
        timeout = httpx.Timeout(self.timeout, read=timeout_seconds + WATCH_READ_GRACE_SECONDS, pool=None)
        try:
            async with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if response.is_error:
                    await response.aread()
                    raise _error_from(response, self.config)
                async for line in response.aiter_lines():
                    if line.strip():
                        event: Manifest = json.loads(line)
                        obj = event.get("object")
                        if isinstance(obj, dict) and event.get("type") != "ERROR":
                            obj.setdefault("apiVersion", api_version)
                            obj.setdefault("kind", kind)
                        yield event
        except httpx.HTTPError as error:
            raise KubeTransportError(f"watch {path}: {error!r}") from error

    async def _list_pages(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        label_selector: str | None,
        field_selector: str | None,
    ) -> tuple[ManifestList, str]:
        """Every page of a list (the one pagination loop): the items, each with its apiVersion and kind,
        and the collection's resourceVersion. Every page of one paginated list is served from the same
        snapshot; the first page names it."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {"limit": str(_LIST_PAGE_SIZE)}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        items: ManifestList = []
        version = ""
        while True:
            page = await self._request("list", "GET", path, params=params)
            version = version or str((page.get("metadata") or {}).get("resourceVersion") or "")
            items += [{"apiVersion": api_version, "kind": kind, **item} for item in page.get("items") or []]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items, version
            params["continue"] = token

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True, dry_run: bool = False
    ) -> Manifest:
        """Server-side apply: creates or updates the fields this manager owns; returns the object."""
        # JSON is YAML: the apply-patch content type accepts a JSON body.
        return await self._patch(
            "apply", self._object_path(obj), obj, APPLY_PATCH, field_manager, force=force, dry_run=dry_run
        )

    async def create(
        self, obj: Mapping[str, Any], *, dry_run: bool = False, field_manager: str | None = None
    ) -> Manifest:
        """POST to the collection (metadata.generateName works); fails with 409 if it exists."""
        api_version, kind, namespace = _kind_and_namespace(obj)
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {"fieldManager": field_manager} if field_manager else None
        return await self._request("create", "POST", path, params=params, body=obj, dry_run=dry_run)

    async def patch_merge(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_manager: str | None = None,
        dry_run: bool = False,
    ) -> Manifest:
        """JSON merge patch (RFC 7386): maps merge, lists are replaced, null deletes a key."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace, name=name)
        return await self._patch("patch", path, patch, MERGE_PATCH, field_manager, dry_run=dry_run)

    async def patch_status(
        self,
        api_version: str,
        kind: str,
        name: str,
        status: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_manager: str | None = None,
        resource_version: str | None = None,
    ) -> Manifest:
        """Merge-patches `.status` through the status subresource.

        With `resource_version`, the patch applies only to that version of the object: the API server
        answers 409 Conflict (`KubeApiError.conflict`) when it changed since (optimistic concurrency).
        """
        path = resource_path(
            self.kind(api_version, kind), namespace=namespace, name=name, subresource="status"
        )
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._patch("patch_status", path, body, MERGE_PATCH, field_manager)

    async def _patch(
        self,
        verb: str,
        path: str,
        body: Mapping[str, Any],
        content_type: str,
        field_manager: str | None,
        *,
        force: bool | None = None,
        dry_run: bool = False,
    ) -> Manifest:
        """The one PATCH: server-side apply (APPLY_PATCH, with `force`) or a JSON merge patch (MERGE_PATCH),
        counted under `verb`."""
        params = {"fieldManager": field_manager} if field_manager else {}
        if force is not None:
            params["force"] = "true" if force else "false"
        return await self._request(
            verb, "PATCH", path, params=params, body=body, content_type=content_type, dry_run=dry_run
        )

    async def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation_policy: str = "Background",
        missing_ok: bool = False,
        uid: str | None = None,
    ) -> None:
        """`uid`: delete only that object (a precondition: another one of the same name is a 409)."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace, name=name)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": propagation_policy,
        }
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("delete", "DELETE", path, body=body)
        except KubeApiError as error:
            if not (missing_ok and error.not_found):
                raise

    async def create_event(
        self,
        involved: Mapping[str, Any],
        *,
        reason: str,
        message: str,
        type: str = "Normal",
        component: str = "mooncake-operator",
    ) -> Manifest:
        """Posts a core/v1 Event about `involved` (a full object as read from the API)."""
        return await self.create(
            event_manifest(involved, reason=reason, message=message, type=type, component=component)
        )
