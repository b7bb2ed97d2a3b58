"""A rank >= 1's entry point: the process ``RankProcesses`` spawns builds its shard's runner,
then runs what rank 0 plans until it stops. The only module of ``pd.parallel`` that builds a
``ModelRunner``."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence

from pd.executor.config import EngineConfig
from pd.executor.runner import ModelRunner
from pd.parallel.group import TensorParallelError
from pd.parallel.plan import PlanReader
from pd.parallel.ranks import RANK_BEAT_S, RankLink

logger = logging.getLogger(__name__)


def _beat(fd: int) -> None:
    """A rank's heartbeat to rank 0 (a frozen process beats no more)."""
    try:
        while True:
            os.write(fd, b"\0")
            time.sleep(RANK_BEAT_S)
    except OSError:  # rank 0 is gone
        return


def main(argv: Sequence[str]) -> int:
    """A rank >= 1: build the shard, then run what rank 0 plans until it stops."""
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING)
    fields = spec["config"]  # JSON has no tuples: a repeatable flag's values came as a list
    cfg = EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    # beating from the start: rank 0 counts a rank's silence from its spawn
    threading.Thread(target=_beat, args=(spec["beat_fd"],), daemon=True).start()
    link = RankLink(
        cfg, rank=spec["rank"], store_dir=spec["store_dir"], machine_nodes=spec["machine_nodes"]
    )
    runner = ModelRunner(cfg, machine_nodes=spec["machine_nodes"], ranks=link)
    runner.make_host_pool()  # its part of rank 0's host tier, if the node has one
    assert link.rank_kv is not None
    reader = PlanReader(spec["plan_fd"])
    try:
        while not (plan := reader.next()).is_stop:
            if plan.seqs is not None:
                runner.forward(plan.seqs, return_all_logits=plan.return_all_logits)
            else:
                assert plan.kv_op is not None
                link.rank_kv.follow(plan.kv_op, plan.src, plan.dst)
    except TensorParallelError as e:
        logger.error("%s", e)
        return 1
    finally:
        runner.close()
    return 0
