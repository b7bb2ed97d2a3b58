"""The node: a loop thread driving an engine core for a role, composed of parts.

``Node`` (``node.py``) owns the loop, the engine core, the transfer agent and the sockets
(``links.py``: ``Inbox``, ``ServerLink``, ``PeerLinks``); the role (``role.py``: ``BaseRole``,
implemented by ``prefill.node.PrefillRole`` and ``decode.node.DecodeRole``) decides what a
message means and what happens around a step. ``heartbeat.py``: what the server hears (cache
events, stats) and the loop's command queue. ``config.py``: what a node is started with.
"""

from pd.node.config import NodeConfig, NodeSettings
from pd.node.heartbeat import NodeResources
from pd.node.node import Node
from pd.node.role import BaseRole, NodeParts

__all__ = ["BaseRole", "Node", "NodeConfig", "NodeParts", "NodeResources", "NodeSettings"]
