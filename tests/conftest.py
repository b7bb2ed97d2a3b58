"""Suite-wide fixtures: the default model and tiny random HF checkpoints, the session's Ray
instance (``ray_session``); ``free_port`` and ``make_node_stats``.

Keep this file light at import time: heavy imports happen inside fixtures.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.hf_reference import hf_greedy as _hf_greedy

if TYPE_CHECKING:
    from pd.core.messages import NodeStatsMsg

# The machine has 2 cores shared by many test processes.
torch.set_num_threads(1)

# Modules that start a pd serve process or a Ray cluster of their own (beside every test that
# uses the shared Ray session): marked ``cluster``, which ``make test-fast`` leaves out.
_CLUSTER_MODULES = {
    "test_churn", "test_e2e", "test_faults", "test_hostile_cluster", "test_local_prefill",
    "test_operate", "test_scaling", "test_serve_cli", "test_serve_keys", "test_serve_sigterm",
    "test_serve_tls", "test_startup",
}  # fmt: skip


# The sections of the run's summary that tests fill through their reports.
MULTIHOST_SECTION = "multihost: what the hosts showed"
_SUMMARY_SECTIONS = (MULTIHOST_SECTION,)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What tests put on their reports for the end of the run (``user_properties`` whose key
    names a section: ``tests/multihost/conftest.py``'s), one section each, in report order;
    tests report here and not in their own conftest so the lines survive pytest-xdist."""
    reports = [r for rs in terminalreporter.stats.values() for r in rs if hasattr(r, "when")]
    reports.sort(key=lambda r: getattr(r, "start", 0.0))
    for section in _SUMMARY_SECTIONS:
        lines = [v for r in reports for k, v in getattr(r, "user_properties", ()) if k == section]
        if lines:
            terminalreporter.section(section)
            for line in lines:
                terminalreporter.write_line(line)
    _slowest_files(terminalreporter, reports)


def _slowest_files(terminalreporter: Any, reports: list[Any], num: int = 20) -> None:
    """The files whose tests took longest (setup, call and teardown summed), so the suite's
    time is seen where it goes (``make test`` must stay under 20 minutes)."""
    by_file: dict[str, float] = {}
    for r in reports:
        path = r.nodeid.split("::", 1)[0]
        by_file[path] = by_file.get(path, 0.0) + getattr(r, "duration", 0.0)
    if len(by_file) < 2:
        return
    total = sum(by_file.values())
    terminalreporter.section(f"the {num} slowest files (seconds, one worker's; all: {total:.0f})")
    for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:num]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")


# The files that take longest (the summary's "slowest files"), longest first. ``make test`` hands
# whole files to two workers in collection order (``--dist loadfile --no-loadscope-reorder``):
# started first, the long files run beside the many short ones, and the workers end together
# instead of one running a long file alone at the end. The chaos soak runs last (``_LAST``): its
# judgements of heartbeats and latency want the cores that a cluster file beside it would take.
_LONGEST_FILES = (
    "tests/cluster/test_exact_defaults.py",
    "tests/multihost/test_onprem_cluster.py",
    "tests/cluster/test_e2e.py",
    "tests/cluster/test_tensor_parallel_live.py",
    "tests/fleet/test_operate.py",
)
_LAST = ("tests/scripts/test_chaos_soak.py",)


def _file_rank(item: pytest.Item) -> int:
    """Where ``item``'s file runs: the longest files first, then every file that starts a
    cluster or a process of its own, then the rest, then the chaos soak."""
    path = item.nodeid.split("::", 1)[0]
    if path in _LONGEST_FILES:
        return _LONGEST_FILES.index(path)
    if path in _LAST:
        return len(_LONGEST_FILES) + 2
    heavy = any(item.get_closest_marker(m) for m in ("soak", "multihost", "cluster"))
    return len(_LONGEST_FILES) + (0 if heavy else 1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.module is not None and (
            item.module.__name__.rsplit(".", 1)[-1] in _CLUSTER_MODULES or "ray_session" in fixtures
        ):
            item.add_marker(pytest.mark.cluster)
    items.sort(key=_file_rank)  # stable: a file's own order (its fixtures' grouping) is kept


# Tokenizer pieces of an HF model dir; copied so tiny checkpoints are complete model dirs.
_TOKENIZER_GLOBS = (
    "tokenizer*",
    "chat_template*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)

# Shared by all tiny checkpoints. Weights drawn with std 0.2 (not HF's 0.02) so that logits
# spread out: greedy decoding then varies its tokens and argmax near-ties are rare.
_TINY_DIMS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

TINY_KINDS = ("llama", "llama_tied", "qwen2", "llama3", "llama_kv3")


def _make_tiny_config(kind: str, vocab_size: int) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    if kind == "llama":
        return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=False, **_TINY_DIMS)
    if kind == "llama_tied":
        return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **_TINY_DIMS)
    if kind == "llama_kv3":  # SmolLM2's heads (9 over 3 KV heads): TP 2 splits them 1 and 2
        dims = {**_TINY_DIMS, "hidden_size": 144, "intermediate_size": 192}
        dims.update(num_attention_heads=9, num_key_value_heads=3)
        return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=False, **dims)
    if kind == "qwen2":
        return Qwen2Config(
            vocab_size=vocab_size,
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            **_TINY_DIMS,
        )
    if kind == "llama3":
        # original_max_position_embeddings=64 puts the scaling's smooth band (wavelengths
        # 16..64 tokens) inside head_dim 16's spectrum, so test-length prompts feel it.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(
            vocab_size=vocab_size, tie_word_embeddings=False, rope_parameters=rope, **_TINY_DIMS
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; known: {TINY_KINDS}")


def _randomize_defaults(model: torch.nn.Module) -> None:
    """HF initializes norm weights to 1 and biases to 0; draw them too, so a model that
    forgets a norm weight or a q/k/v bias cannot match the reference by luck."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)


def write_tiny_checkpoint(kind: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random HF checkpoint of ``kind`` (see TINY_KINDS) plus the tokenizer
    files of ``tokenizer_dir`` into ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    config = _make_tiny_config(kind, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_defaults(model)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for pattern in _TOKENIZER_GLOBS:
        for path in tokenizer_dir.glob(pattern):
            shutil.copy(path, out_dir / path.name)
    return out_dir


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_node_stats(node_id: str, role: str, **counts: float) -> NodeStatsMsg:
    """A node's stats message in which every count is zero but ``counts``."""
    import msgspec

    from pd.core.messages import NodeStatsMsg

    zeros = {f.name: f.type() for f in msgspec.structs.fields(NodeStatsMsg)[2:]}
    return NodeStatsMsg(node_id=node_id, role=role, **{**zeros, **counts})


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A private local Ray instance for the session (the cluster's and the fleet's live tests;
    a test that asks for it is marked ``cluster``)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # a private instance, whatever else runs on the machine
            num_cpus=4,
            include_dashboard=False,
            object_store_memory=80 * 2**20,
            log_to_driver=False,
        )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); converted once per machine."""
    from pd.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[[str], Path]:
    """``make(kind) -> dir``: a tiny random checkpoint with the SmolLM2 tokenizer, written
    once per session per kind."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            out_dir = tmp_path_factory.mktemp(f"tiny_{kind}")
            made[kind] = write_tiny_checkpoint(kind, out_dir, smollm2_dir)
        return made[kind]

    return make


@pytest.fixture(scope="session")
def family_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[[str], Path]:
    """``make(family) -> dir``: a tiny random checkpoint of a model family (tests/families.py),
    written once per session per family."""
    from tests.families import make_family_dir

    return make_family_dir(tmp_path_factory, smollm2_dir, _TOKENIZER_GLOBS)


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    """Llama, GQA 4/2 heads, head_dim 16, 3 layers, untied embeddings."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_kv3_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    """Llama with SmolLM2's heads, 9 over 3 KV heads (head_dim 16): sizes that do not divide
    the KV heads split them unevenly (``pd.model.sharding``)."""
    return tiny_model_factory("llama_kv3")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    """As tiny_llama_dir with tie_word_embeddings=True (no lm_head.weight stored)."""
    return tiny_model_factory("llama_tied")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    """Qwen2 (q/k/v biases, rope_theta 1e6), same dims as tiny_llama_dir."""
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_llama3_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    """Llama with llama3 rope scaling (factor 8, original max 64) and 512 positions."""
    return tiny_model_factory("llama3")


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., list[int]]:
    """``tests.hf_reference.hf_greedy`` as a fixture, for tests that cannot import it."""
    return _hf_greedy
