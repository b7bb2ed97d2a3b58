"""Routing simulation: the real Coordinator over real RadixCaches, no LLM (the model of a prefill
pool: ``pdtools/routing_model.py``).

For each prefill-node count and policy: routing decisions per second (``route`` +
``on_prefilled`` + ``on_finished`` of a request, timed alone, when the recorded calls are
replayed to a fresh coordinator, best of ``--repeats``; the mean rate, and the rate at the median request, which other
jobs on a shared machine taking the CPU for whole time slices barely move), the median rate
measured beside the simulated caches (a pessimistic bound: they leave the CPU caches cold),
cache events applied per second, the coordinator's mirror in bytes per cached token (rebuilt from
every node's snapshot under tracemalloc) beside the previous design (one RadixTree per node,
measured on a few nodes), prefix hit rate, and load imbalance (max / mean prompt tokens routed to
a node). Timings and hit rates cover the second half of the trace, when the caches are full. The
cyclic garbage collector is off while simulating (the caches' millions of objects would make its
passes a cost of the simulation) and on during the replay, with the recorded calls frozen out of
its view.

    python scripts/simulate_routing.py [--nodes 1 4 16 64] [--node-tokens 262144]
        [--policies cache_aware round_robin] [--requests-per-node 1024] [--groups-per-node 4]
        [--sessions-per-group 64] [--in-flight-per-node 2] [--page-size 16] [--repeats 3]
        [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import statistics

from pdtools.routing_model import (
    TraceConfig,
    make_coordinator,
    mirror_bytes,
    replay,
    simulate,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--node-tokens", type=int, default=256 * 1024, help="cache capacity per node")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--requests-per-node", type=int, default=1024)
    p.add_argument("--groups-per-node", type=int, default=4)
    p.add_argument("--sessions-per-group", type=int, default=64)
    p.add_argument("--in-flight-per-node", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--baseline-nodes", type=int, default=4, help="nodes the baseline is built on")
    p.add_argument("--repeats", type=int, default=3, help="replays; the best is shown")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    print(
        "| prefill nodes | policy | cached tokens | decisions/s | decisions/s at p50 "
        "| at p50 beside the caches | events/s | hit rate | imbalance | mirror B/token "
        "| per-node trees B/token |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for num_nodes in args.nodes:
        trace = TraceConfig(
            num_groups=args.groups_per_node * num_nodes,
            sessions_per_group=args.sessions_per_group,
            seed=args.seed,
        )
        num_requests = args.requests_per_node * num_nodes
        for policy in args.policies:
            gc.collect()
            gc.disable()
            r = simulate(
                make_coordinator(policy, num_nodes, args.page_size, args.seed),
                args.node_tokens,
                trace,
                num_requests,
                page_size=args.page_size,
                in_flight=args.in_flight_per_node * num_nodes,
            )
            gc.enable()
            shared, baseline = mirror_bytes(r.nodes, args.page_size, args.baseline_nodes)
            calls, r = r.calls, r._replace(nodes={}, calls=[])
            gc.collect()
            gc.freeze()
            runs = [
                replay(make_coordinator(policy, num_nodes, args.page_size, args.seed), calls, n)
                for n in [num_requests] * args.repeats
            ]
            del calls
            gc.unfreeze()
            print(
                f"| {num_nodes} | {policy} | {r.num_cached_tokens:,} "
                f"| {max(len(t.decision_seconds) / sum(t.decision_seconds) for t in runs):,.0f} "
                f"| {max(1 / statistics.median(t.decision_seconds) for t in runs):,.0f} "
                f"| {1 / statistics.median(r.decision_seconds):,.0f} "
                f"| {max(t.num_events / t.event_seconds for t in runs):,.0f} "
                f"| {r.hit_rate:.1%} | {r.imbalance:.2f} "
                f"| {shared:.2f} | {baseline:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
