"""``NodeActor``: a ``Node`` as the Ray actor the launcher starts.

The only thing it adds is where the node is: its machine's cluster IP and Ray node id, looked up
from Ray inside the actor's process (only it knows which machine Ray placed it on) and handed to
the node in its config, so the node itself never asks Ray.
"""

from __future__ import annotations

import dataclasses

import ray

from decode.node import DecodeRole
from pd.engine.config import EngineConfig
from pd.node import BaseRole, Node, NodeConfig
from prefill.node import PrefillRole

ROLE_CLASSES: dict[str, type[BaseRole]] = {"prefill": PrefillRole, "decode": DecodeRole}


class NodeActor(Node):
    def __init__(self, engine_cfg: EngineConfig, node_cfg: NodeConfig, role: str) -> None:
        node_cfg = dataclasses.replace(
            node_cfg,
            node_ip=ray.util.get_node_ip_address(),
            ray_node_id=ray.get_runtime_context().get_node_id(),
        )
        super().__init__(engine_cfg, node_cfg, ROLE_CLASSES[role])
