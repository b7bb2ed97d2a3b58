"""A server attaching to running nodes (``pd.fleet.launcher.check_adoptable``) refuses settings
that a node cannot take from a peer, naming the flag; the rest it adopts."""

from __future__ import annotations

import pytest

from pd.executor.config import EngineConfig
from pd.fleet.launcher import check_adoptable


def test_a_cluster_of_mixed_kv_dtypes_or_page_sizes_is_refused_naming_the_flag():
    int8 = EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(
        ValueError, match="kv_cache_dtype int8, not auto: start with --kv-cache-dtype int8"
    ):
        check_adoptable(int8, EngineConfig())
    with pytest.raises(
        ValueError, match="kv_cache_dtype auto, not int8: start with --kv-cache-dtype auto"
    ):
        check_adoptable(EngineConfig(), int8)
    with pytest.raises(ValueError, match="page_size 16, not 1: start with --page-size 16"):
        check_adoptable(EngineConfig(page_size=16), EngineConfig())
    check_adoptable(EngineConfig(kv_cache_dtype="int8", seed=3), int8)  # the rest is adopted
