"""Builders shared by the CLI, scripts and tests (top layer: may import prefill/ and decode/)."""

from __future__ import annotations

from pd.cache.radix_cache import RadixCache
from pd.config import EngineConfig
from pd.engine.engine import Engine


def build_engine(cfg: EngineConfig) -> Engine:
    """The colocated engine, with a RadixCache unless ``cfg.enable_prefix_cache`` is off."""
    if not cfg.enable_prefix_cache:
        return Engine(cfg)
    return Engine(cfg, lambda alloc: RadixCache(alloc, node_id="engine"))
