"""The operator's watch cache: MooncakeServings, their children and their pods.

A reconcile reads its inputs here, never from the API server, so a resync with nothing to change makes
no request at all. MooncakeServings are watched by kopf, whose event handler hands each event in
(`record`): the kind is watched once. One list-then-watch per child kind (and per watched namespace)
keeps the other stores current, through the server-side label selector `app.kubernetes.io/managed-by`,
so only the operator's own objects travel. Objects are indexed by their owning resource (`namespace`, the
`app.kubernetes.io/instance` label; a MooncakeServing owns itself), and every change calls `on_change`
with that owner, which is how an event on a child (a pod became Ready, a replica was replaced, a child
was edited or deleted) wakes the owner's reconcile at once.

Why our own watches of the children rather than kopf indexes: the cache also absorbs the objects the
operator's own writes return (`remember`, wired to `KubeClient.on_write`), so the next reconcile never
acts on a state older than what it wrote (a kopf index cannot be written to); it stores a projection
(no managedFields; pods reduced to what readiness reads), compactly (below); and one event costs one
store update, not a kopf handler invocation, for thousands of objects on few cores.

Each object is kept as the compact JSON text of its projection and decoded on every read: as parsed dicts
(every key and value a separate Python object, the keys copied per object) the 1,000 resources' objects
took about 5 times the memory, the largest part of the operator's RSS; a reconcile reads about a dozen
objects of a few KiB, microseconds each. Every read returns a fresh copy, so no caller can alter the
cache by mutating what it got.

Pods the cache does not keep (no workload controller created them) but that a resource's client Service
selects are remembered by name only, a few per resource (`MAX_FOREIGN_NAMES`), so the reconcile can report
them (`observe`, status.foreignPods) without a tenant's pods growing the operator's memory.

Stores are monotonic: an object is replaced only by a newer resourceVersion, so a late watch event
never overwrites what a write returned. (resourceVersions are etcd revisions: integers that grow.
Kubernetes calls them opaque; when one is not an integer, the newest event wins.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.status import MAX_FOREIGN_PODS
from mooncake_operator.build.names import (
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    TRAFFIC_LABEL,
    client_selector,
)
from mooncake_operator.build.ownership import controlled_by, controller_reference, owner_references
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError, KubeError
from mooncake_operator.kube.kinds import Manifest

logger = logging.getLogger("mooncake_operator.cache")

MANAGED_SELECTOR: Final = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
RELIST_BACKOFF_SECONDS: Final = 1.0
# A watch the server ends sooner than this is followed after RELIST_BACKOFF_SECONDS, not at once: a
# proxy that cuts every stream must not make the operator spin.
SHORT_WATCH_SECONDS: Final = 1.0
GONE: Final = 410

Key = tuple[str, str]  # namespace, name
OnChange = Callable[[str, str], None]  # namespace, owner


@dataclass(frozen=True)
class WatchedKind:
    api_version: str
    kind: str
    label_selector: str | None


# Stored, but watched by kopf (handlers.py), which hands its events in through `WatchCache.record`.
SERVING: Final = WatchedKind(API_VERSION, KIND, None)
WATCHED_KINDS: Final = (
    WatchedKind("v1", "ConfigMap", MANAGED_SELECTOR),
    WatchedKind("v1", "Service", MANAGED_SELECTOR),
    WatchedKind("apps/v1", "Deployment", MANAGED_SELECTOR),
    WatchedKind("apps/v1", "StatefulSet", MANAGED_SELECTOR),
    WatchedKind("v1", "Pod", MANAGED_SELECTOR),
    WatchedKind("networking.k8s.io/v1", "NetworkPolicy", MANAGED_SELECTOR),
)
# Its API version depends on the server (policy/v1 from 1.21): watched once discovery has said which.
PDB_KIND: Final = "PodDisruptionBudget"


def version_number(resource_version: str | None) -> int | None:
    try:
        return int(resource_version) if resource_version else None
    except ValueError:
        return None


def resource_version(obj: Mapping[str, Any]) -> str | None:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return str(version) if version is not None else None


def is_older(candidate: str | None, stored: str | None) -> bool:
    """Whether resourceVersion `candidate` is older than `stored` (never when unknowable)."""
    new, old = version_number(candidate), version_number(stored)
    return new is not None and old is not None and new < old


# The pod labels the operator reads (the owner, the component, observe.TEMPLATE_HASH_LABEL, the traffic label,
# and managed-by: with them, whether the client Service selects the pod): a pod's other labels are
# anyone's to add, and would all be kept.
POD_LABELS_READ: Final = frozenset(
    {
        LABEL_INSTANCE,
        LABEL_COMPONENT,
        LABEL_MANAGED_BY,
        "controller-revision-hash",
        TRAFFIC_LABEL,
    }
)
# Foreign pods (not a workload controller's: never kept) that the client Service of a resource selects
# are remembered by name only, at most this many per resource: enough to report them, bounded whatever
# a tenant creates.
MAX_FOREIGN_NAMES: Final = MAX_FOREIGN_PODS


def is_kept(obj: Mapping[str, Any]) -> bool:
    """Whether the cache keeps `obj`. The watches select by the managed-by label, which anyone who may
    create a ConfigMap can set: only a child with a controller reference to a MooncakeServing (what the
    operator creates) or a pod of a workload controller is kept, so no stray labelled object fills it."""
    kind = obj.get("kind")
    if kind == KIND:
        return True
    if kind == "Pod":  # created by its StatefulSet, or the single master's Deployment's ReplicaSet
        workloads = ("StatefulSet", "ReplicaSet")
        return any(ref.get("kind") in workloads for ref in owner_references(obj))
    return controlled_by(obj, KIND, None, api_version=API_VERSION, any_uid=True)


def in_client_service(obj: Mapping[str, Any]) -> str | None:
    """The resource whose client Service selects this pod by its labels (`build.names.client_selector`),
    or None."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    owner = labels.get(LABEL_INSTANCE)
    if obj.get("kind") != "Pod" or not isinstance(owner, str):
        return None
    wanted = client_selector(owner)
    return owner if all(labels.get(key) == value for key, value in wanted.items()) else None


def project(obj: Mapping[str, Any]) -> Manifest:
    """What the cache keeps of an object: all but managedFields; of a pod, only what readiness and the
    canary read (`observe.pod_info`: name, uid, the labels it reads, its controller reference, deletion,
    Ready, restart counts, its IP)."""
    metadata = {key: value for key, value in (obj.get("metadata") or {}).items() if key != "managedFields"}
    if obj.get("kind") != "Pod":
        return {**obj, "metadata": metadata}
    status = obj.get("status") or {}
    controller = controller_reference(obj)
    kept_status: dict[str, Any] = {
        "conditions": [
            {"type": c.get("type"), "status": c.get("status")} for c in status.get("conditions") or []
        ],
        "containerStatuses": [
            {"name": c.get("name"), "restartCount": c.get("restartCount", 0)}
            for c in status.get("containerStatuses") or []
        ],
    }
    if status.get("podIP"):
        kept_status["podIP"] = status["podIP"]
    kept_metadata = {
        **{
            key: metadata[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp")
            if key in metadata
        },
        "labels": {
            key: value for key, value in (metadata.get("labels") or {}).items() if key in POD_LABELS_READ
        },
    }
    if controller is not None:
        kept_metadata["ownerReferences"] = [
            {key: controller[key] for key in ("kind", "name", "uid", "controller") if key in controller}
        ]
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": "Pod",
        "metadata": kept_metadata,
        "status": kept_status,
    }


def owner_of(obj: Mapping[str, Any]) -> str | None:
    """The MooncakeServing an object belongs to: itself, or the one its instance label names."""
    metadata = obj.get("metadata") or {}
    if obj.get("kind") == KIND:
        return metadata.get("name")
    return (metadata.get("labels") or {}).get(LABEL_INSTANCE)


@dataclass(frozen=True, slots=True)
class Entry:
    """A stored object: what the store compares and indexes by, and the projection as compact JSON."""

    resource_version: str | None
    owner: str | None
    encoded: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Entry:
        projected = project(obj)
        return cls(
            resource_version(projected),
            owner_of(projected),
            json.dumps(projected, separators=(",", ":"), check_circular=False),
        )

    def decoded(self) -> Manifest:
        value: Manifest = json.loads(self.encoded)
        return value


@dataclass
class Store:
    """The objects of one kind, by (namespace, name) and by owner; each change reports the owner."""

    on_change: OnChange
    objects: dict[Key, Entry] = field(default_factory=dict)
    by_owner: dict[Key, set[str]] = field(default_factory=dict)
    # Pods not kept (no workload controller made them) that a resource's client Service selects: their
    # names by (namespace, owner), at most MAX_FOREIGN_NAMES each (the first found).
    foreign: dict[Key, set[str]] = field(default_factory=dict)
    foreign_owner: dict[Key, str] = field(default_factory=dict)  # (namespace, pod name) -> owner

    def get(self, namespace: str, name: str) -> Manifest | None:
        """A fresh copy of the stored object (callers may change it)."""
        entry = self.objects.get((namespace, name))
        return entry.decoded() if entry is not None else None

    def owned(self, namespace: str, owner: str) -> list[Manifest]:
        names = self.by_owner.get((namespace, owner), ())
        return [self.objects[(namespace, name)].decoded() for name in sorted(names)]

    def foreign_names(self, namespace: str, owner: str) -> list[str]:
        """Pods not kept that the client Service of `owner` selects (at most MAX_FOREIGN_NAMES)."""
        return sorted(self.foreign.get((namespace, owner), ()))

    def put(self, obj: Mapping[str, Any]) -> bool:
        """Store `obj` unless the stored version is as new; True (and the owner told) when it changed."""
        key = _key(obj)
        version = resource_version(obj)
        if not is_kept(obj):  # (and one that lost its owner reference goes)
            self._delete(key, version)
            self._note_foreign(key, in_client_service(obj))
            return False
        self._note_foreign(key, None)
        stored = self.objects.get(key)
        if stored is not None and (
            is_older(version, stored.resource_version) or version == stored.resource_version
        ):
            return False
        if stored is not None:
            self._unindex(key, stored)
        entry = Entry.of(obj)
        self.objects[key] = entry
        if entry.owner:
            self.by_owner.setdefault((key[0], entry.owner), set()).add(key[1])
            self.on_change(key[0], entry.owner)
        return True

    def delete(self, obj: Mapping[str, Any]) -> None:
        self._delete(_key(obj), resource_version(obj))
        self._note_foreign(_key(obj), None)

    def _note_foreign(self, key: Key, owner: str | None) -> None:
        """Remember the foreign pod `key` under `owner` (None: under no owner any more); the owner whose
        set changed is told."""
        namespace, name = key
        before = self.foreign_owner.get(key)
        if before == owner:
            return
        if before is not None:
            del self.foreign_owner[key]
            names = self.foreign[(namespace, before)]
            names.discard(name)
            if not names:
                del self.foreign[(namespace, before)]
            self.on_change(namespace, before)
        if owner is None:
            return
        names = self.foreign.setdefault((namespace, owner), set())
        if len(names) < MAX_FOREIGN_NAMES:
            names.add(name)
            self.foreign_owner[key] = owner
            self.on_change(namespace, owner)

    def apply(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (type None: listed): the object stored if newer, or deleted; a bookmark is
        not an object."""
        if event_type == "DELETED":
            self.delete(obj)
        elif event_type in (None, "ADDED", "MODIFIED"):
            self.put(obj)

    def replace(self, items: Iterable[Mapping[str, Any]], namespace: str | None, version: str) -> None:
        """A fresh list (of one namespace, or of all): what it lacks is gone, unless stored after it."""
        listed: set[Key] = set()
        for item in items:
            listed.add(_key(item))
            self.put(item)
        for key, stored in list(self.objects.items()):
            in_scope = namespace is None or key[0] == namespace
            if in_scope and key not in listed and not is_older(version, stored.resource_version):
                self._delete(key, stored.resource_version)
        for key in [key for key in self.foreign_owner if namespace in (None, key[0]) and key not in listed]:
            self._note_foreign(key, None)

    def _delete(self, key: Key, version: str | None) -> None:
        stored = self.objects.get(key)
        if stored is None or is_older(version, stored.resource_version):
            return  # already gone, or a newer object of that name was stored meanwhile
        del self.objects[key]
        self._unindex(key, stored)
        if stored.owner:
            self.on_change(key[0], stored.owner)

    def _unindex(self, key: Key, stored: Entry) -> None:
        if stored.owner:
            names = self.by_owner.get((key[0], stored.owner))
            if names is not None:
                names.discard(key[1])
                if not names:
                    del self.by_owner[(key[0], stored.owner)]


def _key(obj: Mapping[str, Any]) -> Key:
    metadata = obj.get("metadata") or {}
    return (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))


@dataclass
class Wakes:
    """One wake-up flag per running worker, by (namespace, name)."""

    events: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)

    def register(self, namespace: str, name: str) -> asyncio.Event:
        return self.events.setdefault((namespace, name), asyncio.Event())

    def unregister(self, namespace: str, name: str) -> None:
        self.events.pop((namespace, name), None)

    def poke(self, namespace: str, name: str) -> None:
        event = self.events.get((namespace, name))
        if event is not None:
            event.set()


class WatchCache:
    """Stores for every watched kind, kept current by one list-then-watch per kind and namespace, and
    the MooncakeServings' store, kept current by the events kopf's watch hands in (`record`)."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        namespaces: tuple[str, ...],
        on_change: OnChange,
        watch_timeout_seconds: float = 300.0,
        kinds: tuple[WatchedKind, ...] = WATCHED_KINDS,
    ) -> None:
        self.kube = kube
        self.namespaces: tuple[str | None, ...] = namespaces or (None,)
        self.watch_timeout_seconds = watch_timeout_seconds
        self.kinds = kinds
        self._on_change = on_change
        self.stores = {(k.api_version, k.kind): Store(on_change) for k in (SERVING, *kinds)}
        self._listed: set[tuple[WatchedKind, str | None]] = set()
        self._synced = asyncio.Event()
        self._kind_listed: dict[WatchedKind, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Starts the watches (in the running event loop)."""
        for kind in self.kinds:
            for namespace in self.namespaces:
                self._tasks.append(asyncio.create_task(self._follow(kind, namespace)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def wait_synced(self) -> None:
        """Returns once every store holds a complete first list."""
        await self._synced.wait()

    async def watch_kind(self, kind: WatchedKind) -> None:
        """Adds a kind known only at run time (once), and returns when its first list is in."""
        if (kind.api_version, kind.kind) not in self.stores:
            self.kinds = (*self.kinds, kind)
            self.stores[(kind.api_version, kind.kind)] = Store(self._on_change)
            for namespace in self.namespaces:
                self._tasks.append(asyncio.create_task(self._follow(kind, namespace)))
        await self._kind_listed.setdefault(kind, asyncio.Event()).wait()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        return self.stores[(api_version, kind)].get(namespace, name)

    def owned(self, api_version: str, kind: str, namespace: str, owner: str) -> list[Manifest]:
        """The objects of `kind` that belong to the MooncakeServing `owner`, by name."""
        return self.stores[(api_version, kind)].owned(namespace, owner)

    def foreign_pods(self, namespace: str, owner: str) -> list[str]:
        """Pods no workload controller created that `owner`'s client Service selects (a bounded few)."""
        return self.stores[("v1", "Pod")].foreign_names(namespace, owner)

    def remember(self, obj: Mapping[str, Any]) -> None:
        """An object an API call returned (a write, or a read after a conflict): stored if newer."""
        store = self.stores.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
        if store is not None and (obj.get("metadata") or {}).get("namespace"):
            store.put(obj)

    def record(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """An event of kopf's watch of MooncakeServings."""
        self.stores[(SERVING.api_version, SERVING.kind)].apply(event_type, obj)

    def forget(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """An object a read found missing."""
        self.stores[(api_version, kind)].delete({"metadata": {"namespace": namespace, "name": name}})

    async def _follow(self, kind: WatchedKind, namespace: str | None) -> None:
        store = self.stores[(kind.api_version, kind.kind)]
        version: str | None = None
        while True:
            try:
                if version is None:
                    items, version = await self.kube.list_snapshot(
                        kind.api_version, kind.kind, namespace, label_selector=kind.label_selector
                    )
                    store.replace(items, namespace, version)
                    self._mark_listed(kind, namespace)
                started = time.monotonic()
                version = await self._watch(kind, namespace, store, version)
                if time.monotonic() - started < SHORT_WATCH_SECONDS:
                    await asyncio.sleep(RELIST_BACKOFF_SECONDS)
            except KubeError as error:
                logger.warning("watch %s %s: %s; retrying", kind.kind, namespace or "(all)", error)
                if isinstance(error, KubeApiError) and error.status == GONE:
                    version = None
                await asyncio.sleep(RELIST_BACKOFF_SECONDS)
            except Exception:
                # A bug, not the API server: logged, and the kind listed afresh (the cache must not stop).
                logger.exception("watch %s %s failed; listing again", kind.kind, namespace or "(all)")
                version = None
                await asyncio.sleep(RELIST_BACKOFF_SECONDS)

    async def _watch(
        self, kind: WatchedKind, namespace: str | None, store: Store, version: str
    ) -> str | None:
        """Follows one watch request; returns the version to continue from (None: list again)."""
        async for event in self.kube.watch(
            kind.api_version,
            kind.kind,
            namespace,
            resource_version=version,
            label_selector=kind.label_selector,
            timeout_seconds=int(self.watch_timeout_seconds),
        ):
            kind_of_event, obj = event.get("type"), event.get("object") or {}
            if kind_of_event == "ERROR":
                if obj.get("code") == GONE:  # too old to continue from: list again
                    return None
                raise KubeApiError(
                    int(obj.get("code") or 500), str(obj.get("reason")), str(obj.get("message"))
                )
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            store.apply(kind_of_event, obj)
        return version

    def _mark_listed(self, kind: WatchedKind, namespace: str | None) -> None:
        self._listed.add((kind, namespace))
        if all((kind, ns) in self._listed for ns in self.namespaces):
            self._kind_listed.setdefault(kind, asyncio.Event()).set()
        if all((k, ns) in self._listed for k in self.kinds for ns in self.namespaces):
            self._synced.set()
