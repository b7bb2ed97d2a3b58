"""Tensor parallel (above ``pd.executor``): a node of N ranks. Rank 0 (the node as ever) plans
each step, ranks 1..N-1 follow.

    rank 0 (the node's process)              rank r >= 1 (a process rank 0 started)
    ------------------------------------     ---------------------------------------
    RankLink.join: spawn ranks          ->   pd.parallel.main.main
    load its shard                           load its shard
    TPGroup: join the group (FileStore) <->  TPGroup: join the group
    each step: PlanWriter.forward(seqs) ->   PlanReader.next() -> the same forward
    forward, two all-reduces a layer    <->  forward, the same all-reduces
    sample (rank 0 alone)
    close: PlanWriter.stop()            ->   exit

The rooms: ``group`` (the ranks joined, the sums and copies between them), ``plan`` (what rank
0 sends each step, as a few int32 arrays down a pipe per rank: no pickling), ``ranks`` (the
ranks' processes, and ``RankLink``: the runner's seam ``pd.executor.rank_link`` implemented),
``rank_kv`` (KV copies that every rank makes on its shard) and ``main`` (a rank's entry point,
the only module that builds a runner).

Fate is shared: a rank that exits or errs makes rank 0's next sum fail
(``TensorParallelError``), and the node stops (a cluster replaces it); rank 0's death closes
the pipes (and the kernel kills its ranks: ``PR_SET_PDEATHSIG``), so no rank outlives it.
"""
