"""The store config (mooncake_store.json) every replica reads, its ConfigMap, and the master address
in it: the master Service, or etcd when the masters elect a leader.
"""

from __future__ import annotations

import json
import posixpath

from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.digests import short_digest
from mooncake_operator.build.engine_args import DEFAULT_STORE_CONFIG_PATH, replica_launch
from mooncake_operator.build.etcd import ha_topology
from mooncake_operator.build.names import COMPONENT_STORE_CONFIG, ChildNames, Manifest, labels, object_meta

# The ConfigMap is mounted as the directory of the path engine_args puts into MOONCAKE_CONFIG_PATH.
STORE_CONFIG_DIR, STORE_CONFIG_KEY = posixpath.split(DEFAULT_STORE_CONFIG_PATH)


def store_config_json(resource: MooncakeServing) -> str:
    launch = replica_launch(resource.spec, master_address=master_address(resource), ha=ha_topology(resource))
    return json.dumps(dict(launch.store_config), indent=2) + "\n"


def config_hash(resource: MooncakeServing) -> str:
    return short_digest(store_config_json(resource))


def master_address(resource: MooncakeServing) -> str:
    """The store config's master address: the master Service, or etcd when the masters elect a leader."""
    ha = ha_topology(resource)
    if ha is not None:
        return ha.master_server_address
    names = ChildNames.of(resource.metadata.name)
    return f"{names.master}.{resource.metadata.namespace}.svc:{resource.spec.store.master.rpc_port}"


def store_config_map(resource: MooncakeServing, *, owner_uid: str | None) -> Manifest:
    names = ChildNames.of(resource.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(
            resource,
            names.store_config,
            labels(resource, "mooncake-store", COMPONENT_STORE_CONFIG),
            owner_uid,
        ),
        "data": {STORE_CONFIG_KEY: store_config_json(resource)},
    }
