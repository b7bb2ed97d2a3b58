"""How many nodes of a pool the Ray cluster can hold, so that ``/admin/scale`` refuses a size
that could never fill (409, with the numbers) instead of starting a pool that waits forever.

A node asks Ray for what ``NodeActors.start`` gives it: with GPUs, a CPU and its GPUs;
its role's custom resources (``--prefill-resources``) either way. A CPU node without custom
resources asks Ray for nothing (Ray would place any number of them, and CPU nodes share cores:
``pd serve --prefill 2 --decode 2`` runs on two), so what bounds them is memory: such a node is
counted as the resident memory the running nodes measure (the largest a node reports), or,
before any has reported, its checkpoint's bytes. The resources counted are the alive Ray
nodes' totals (on the private local instance, whose CPU count and memory pd sets itself, the
machine's cores and physical memory), raised to what Ray's autoscaler reports it may grow the
cluster to when it runs (its node types' ``max_workers``); the other pool's nodes hold their
share. Packing is not modelled
(fractional GPUs over several machines): the count is an upper bound, and a node that Ray
still cannot place fails its start (``ready_timeout_s``) and lowers the target again. Nor can
the cluster grow past what the server's socket takes (``socket_capacity``: one connection per
node, ``--transfer-max-conns``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import NamedTuple

logger = logging.getLogger(__name__)
Resources = Mapping[str, float]


class Capacity(NamedTuple):
    max_nodes: int
    why: str  # how it was counted, for the refusal's message


def node_demand(gpus: float, custom: Resources, memory_bytes: float) -> dict[str, float]:
    """What one node takes: as it asks Ray, or ``memory_bytes`` of memory when it asks for
    nothing (a CPU node without custom resources)."""
    demand = {"CPU": 1.0, "GPU": gpus} if gpus else {}
    demand.update(custom)
    return demand or {"memory": float(memory_bytes)}


def max_nodes(totals: Resources, demand: Resources, held: Resources) -> int:
    """How many nodes taking ``demand`` fit in ``totals`` once ``held`` is taken."""
    fits = [
        math.floor((totals.get(name, 0.0) - held.get(name, 0.0)) / amount + 1e-9)
        for name, amount in demand.items()
    ]
    return max(0, min(fits))


def pool_capacity(
    role: str,
    demand: Resources,
    other_role: str,
    other_demand: Resources,
    num_other: int,
    totals: Resources,
    autoscaler_max: Resources | None,
) -> Capacity:
    """The most ``role`` nodes beside ``num_other`` nodes of ``other_role``."""
    if autoscaler_max:
        totals = {
            n: max(totals.get(n, 0.0), autoscaler_max.get(n, 0.0))
            for n in {*totals, *autoscaler_max}
        }
    held = {name: num_other * amount for name, amount in other_demand.items()}
    n = max_nodes(totals, demand, held)
    have = ", ".join(f"{name} {_num(name, totals.get(name, 0.0))}" for name in demand)
    why = f"a {role} node takes {_resources(demand)}; the cluster has {have}" + (
        " (as far as Ray's autoscaler may grow it)" if autoscaler_max else ""
    )
    if any(name in held for name in demand) and num_other:
        why += f", of which the {num_other} {other_role} node(s) hold {_resources(held)}"
    return Capacity(n, why)


def socket_capacity(cap: Capacity, num_other: int, max_conns: int) -> Capacity:
    """``cap``, or fewer where the server's socket could not take them: each internal socket
    takes ``max_conns`` connections (``transfer.conn_cap``), one per node and one for the
    server, so at most ``max_conns - 1`` nodes in all."""
    n = max(0, max_conns - 1 - num_other)
    if n >= cap.max_nodes:
        return cap
    why = (
        f"each internal socket takes {max_conns} connections (--transfer-max-conns): at most "
        f"{max_conns - 1} nodes, {num_other} of them in the other pool"
    )
    return Capacity(n, why)


def ray_totals(is_local: bool) -> dict[str, float]:
    """The alive Ray nodes' resources, summed (blocking: it asks Ray's GCS). On the private
    local instance, CPU is the machine's cores (its Ray CPU count is pd's own choice)."""
    import ray

    totals: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for name, amount in node.get("Resources", {}).items():
                totals[name] = totals.get(name, 0.0) + float(amount)
    if is_local:
        totals["CPU"] = float(os.cpu_count() or 1)
        totals["memory"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return totals


def ray_autoscaler_max() -> dict[str, float] | None:
    """The resources Ray's autoscaler says it may grow the cluster to, or None when no
    autoscaler reported its configuration (a fixed cluster, a local instance). Blocking."""
    try:
        from ray._private.state import state

        found = state.get_max_resources_from_cluster_config()
    except Exception as e:  # a private API of Ray: without it, the alive nodes are the bound
        logger.debug("no autoscaler configuration from Ray: %s: %s", type(e).__name__, e)
        return None
    return None if not found else {name: float(v) for name, v in found.items()}


def _num(name: str, x: float) -> str:
    if name == "memory":  # Ray counts it in bytes
        return f"{x / 2**30:.2f} GiB"
    return str(int(x)) if x == int(x) else f"{x:g}"


def _resources(resources: Resources) -> str:
    return ", ".join(f"{name} {_num(name, amount)}" for name, amount in resources.items())
