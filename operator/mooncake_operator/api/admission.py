"""What an operator refuses beyond the schema, by its own settings: node-level options (a privileged
replica, the node's network) that only the cluster's administrator may allow. One source for the
operator (`run --allow-*`, runtime/settings.py) and `render --allow-*`, so both refuse the same
resources with the same words.
"""

from __future__ import annotations

from mooncake_operator.api.spec import MooncakeServingSpec


def refused_node_options(
    spec: MooncakeServingSpec, *, allow_privileged_engines: bool, allow_host_network: bool
) -> list[str]:
    """A line per node-level option `spec` asks for that is not allowed (nothing is applied for such a
    resource)."""
    rdma = spec.store.rdma
    if rdma is None:
        return []
    problems = []
    if rdma.host_devices and not allow_privileged_engines:
        problems.append(
            "spec.store.rdma.hostDevices needs a privileged replica container, which this operator "
            "does not allow (--allow-privileged-engines, chart value operator.allowPrivilegedEngines): "
            "use store.rdma.resourceName (the RDMA device plugin) or ask the cluster's administrator"
        )
    if rdma.host_network and not allow_host_network:
        problems.append(
            "spec.store.rdma.hostNetwork puts replicas on the node's network, which this operator does "
            "not allow (--allow-host-network, chart value operator.allowHostNetwork): use "
            "store.rdma.networks (Multus) or ask the cluster's administrator"
        )
    return problems
