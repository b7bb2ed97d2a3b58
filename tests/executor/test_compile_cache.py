"""Compiled decode steps kept on disk (``pd.executor.compile_cache``): a second start in a fresh
process loads every bucket instead of compiling it and gives the same greedy tokens; a corrupt or
truncated file is removed and compiled again, with the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd.executor.compile_cache import _unwrap, _wrap, entry_key, prune

_START = """
import json, sys
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
engine = Engine(EngineConfig(model=sys.argv[1], max_total_tokens=1024, num_threads=1,
                             compile_buckets="1,2", compile_cache=sys.argv[2]))
greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
tokens = [r.token_ids for r in engine.generate([[5, 6, 7, 8], [9, 10, 11]], greedy)]
tokens += [r.token_ids for r in engine.generate([[12, 13, 14, 15, 16]], greedy)]
graphs = engine.runner.graphs
cache = graphs.cache
print(json.dumps({
    "loaded": sorted(graphs.loaded), "compiled": sorted(graphs.compile_seconds),
    "saved": cache.num_saved if cache else 0, "rejected": cache.num_rejected if cache else 0,
    "runs": {str(b): n for b, n in graphs.num_runs.items()},
    "fallbacks": graphs.num_eager_fallbacks, "tokens": tokens,
}))
"""


def _start(model_dir: Path, cache: str) -> dict:
    """An engine started in a fresh process (as a restarted node is): what it loaded, compiled,
    kept and ran, and its greedy tokens."""
    done = subprocess.run(
        [sys.executable, "-c", _START, str(model_dir), cache],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_file_is_read_back_only_whole_and_unaltered():
    data = _wrap(b"payload")
    assert _unwrap(data) == b"payload"
    for bad in (data[:-1], data[:10], data[:-1] + b"X", b"", b"other" + data):
        with pytest.raises(ValueError):
            _unwrap(bad)


def test_the_key_changes_with_any_part_of_the_identity():
    base = {"weights": "a", "flags": "b"}
    assert entry_key(base) == entry_key(dict(base))
    assert entry_key(base) != entry_key({**base, "weights": "c"})
    assert entry_key(base) != entry_key({**base, "rank": "1 of 2"})


def test_prune_keeps_the_most_recently_used_entries(tmp_path):
    now = time.time()
    for i in range(5):
        (tmp_path / f"e{i}").mkdir()
        os.utime(tmp_path / f"e{i}", (now - 100 + i, now - 100 + i))
    removed = prune(tmp_path, keep="e0", max_entries=2)
    assert sorted(p.name for p in removed) == ["e1", "e2"]  # e0 is in use, e3 and e4 newer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0", "e3", "e4"]


def test_the_shared_kernels_are_no_entry_and_are_emptied_past_their_bound(tmp_path):
    kernels = tmp_path / "inductor"
    kernels.mkdir()
    os.utime(kernels, (0, 0))  # the oldest directory, yet not an entry to remove
    (kernels / "k.so").write_bytes(b"x" * 100)
    (tmp_path / "e0").mkdir()
    assert prune(tmp_path, keep="e0", max_entries=1, max_inductor_bytes=100) == []
    assert prune(tmp_path, keep="e0", max_entries=1, max_inductor_bytes=99) == [kernels]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_second_start_loads_its_steps_and_a_corrupt_one_is_compiled_again(
    tiny_llama_dir, tmp_path
):
    eager = _start(tiny_llama_dir, "off")
    assert eager["compiled"] == [1, 2] and eager["saved"] == 0

    cold = _start(tiny_llama_dir, str(tmp_path))
    assert (cold["loaded"], cold["saved"]) == ([], 2)
    warm = _start(tiny_llama_dir, str(tmp_path))
    assert (warm["loaded"], warm["saved"], warm["rejected"]) == ([1, 2], 0, 0)
    # the loaded steps ran (not an eager fallback), and gave the same tokens
    assert warm["runs"]["1"] > 0 and warm["runs"]["2"] > 0 and warm["fallbacks"] == 0
    assert warm["tokens"] == cold["tokens"] == eager["tokens"]

    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "inductor"]
    one, two = entry / "step-1.bin", entry / "step-2.bin"
    data = bytearray(one.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    one.write_bytes(bytes(data))
    two.write_bytes(two.read_bytes()[: len(data) // 3])  # a write cut short
    healed = _start(tiny_llama_dir, str(tmp_path))
    assert (healed["loaded"], healed["rejected"], healed["saved"]) == ([], 2, 2)
    assert healed["tokens"] == eager["tokens"] and healed["fallbacks"] == 0
    again = _start(tiny_llama_dir, str(tmp_path))
    assert again["loaded"] == [1, 2] and again["tokens"] == eager["tokens"]
