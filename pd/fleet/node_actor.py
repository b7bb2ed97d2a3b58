"""The Ray actors the launcher starts: ``PrefillNode`` and ``DecodeNode``, each a ``Node`` with
its role (named by role, so `ps` and Ray's dashboard show which is which: ``ray::PrefillNode``).

The only thing they add is where the node is: its machine's cluster IP and Ray node id, looked
up from Ray inside the actor's process (only it knows which machine Ray placed it on) and handed
to the node in its config, so the node itself never asks Ray.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import ray

from decode.node import DecodeRole
from pd.executor.config import EngineConfig
from pd.node import BaseRole, Node, NodeConfig
from prefill.node import PrefillRole


class NodeActor(Node):
    role_cls: ClassVar[type[BaseRole]]

    def __init__(self, engine_cfg: EngineConfig, node_cfg: NodeConfig) -> None:
        node_cfg = dataclasses.replace(
            node_cfg,
            node_ip=ray.util.get_node_ip_address(),
            ray_node_id=ray.get_runtime_context().get_node_id(),
        )
        super().__init__(engine_cfg, node_cfg, self.role_cls)


class PrefillNode(NodeActor):
    role_cls = PrefillRole


class DecodeNode(NodeActor):
    role_cls = DecodeRole


ACTOR_CLASSES: dict[str, type[NodeActor]] = {"prefill": PrefillNode, "decode": DecodeNode}
