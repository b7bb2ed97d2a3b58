"""Deterministic inference (``EngineConfig.deterministic``, the default): a token's KV and its
logits have the same bits however the token was computed. A prompt is run through the runner in
one chunk, in chunks, in a batch beside other prompts, and half prefilled then decoded one row at
a time (alone and beside other decoding rows, eagerly and in a compiled step), in every weight
format; every way must write the KV and give the logits of the first, bit for bit.

``--no-deterministic`` is shown to differ on the same schedules, so these tests can fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pd.core.batch import SeqInput
from pd.executor.config import EngineConfig
from pd.executor.runner import ModelRunner

Schedule = Callable[["_Probe"], tuple[torch.Tensor, torch.Tensor]]


class _Probe:
    """Runs one prompt through a runner in several ways, each in fresh slots; -> (KV of every
    layer for the prompt's tokens, the logits after its last token)."""

    def __init__(self, runner: ModelRunner, prompt_len: int, seed: int = 0) -> None:
        self.runner = runner
        g = torch.Generator().manual_seed(seed)
        vocab = runner.model_config.vocab_size
        self.prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        self.others = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (50, 9, 140)]
        self._next = 0

    def slots(self, n: int) -> list[int]:
        """``n`` slots no other run used (the pool is large enough for all of them)."""
        self._next += n
        return list(range(self._next - n, self._next))

    def kv(self, slots: list[int]) -> torch.Tensor:
        pool = self.runner.pool
        layers = [torch.stack((pool.k[i][slots], pool.v[i][slots])) for i in range(pool.num_layers)]
        return torch.stack(layers)

    def one_chunk(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slots(len(self.prompt))
        logits = self.runner.forward([SeqInput(self.prompt, s, 0)])
        return self.kv(s), logits[-1]

    def chunks(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, s = len(self.prompt), self.slots(len(self.prompt))
        for i in range(0, n, size):
            end = min(n, i + size)
            logits = self.runner.forward([SeqInput(self.prompt[i:end], s[:end], i)])
        return self.kv(s), logits[-1]

    def batched(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slots(len(self.prompt))
        seqs = [SeqInput(o, self.slots(len(o)), 0) for o in self.others]
        logits = self.runner.forward([*seqs, SeqInput(self.prompt, s, 0)])
        return self.kv(s), logits[-1]

    def decoded(self, num_prefilled: int, num_beside: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_prefilled`` tokens prefilled, the rest as one-token decode rows, each
        step beside ``num_beside`` other decoding requests."""
        n, s = len(self.prompt), self.slots(len(self.prompt))
        self.runner.forward([SeqInput(self.prompt[:num_prefilled], s[:num_prefilled], 0)])
        beside = []
        for other in self.others[:num_beside]:
            os = self.slots(len(other) + n)
            self.runner.forward([SeqInput(other, os[: len(other)], 0)])
            beside.append((other, os))
        for i in range(num_prefilled, n):
            rows = [SeqInput(self.prompt[i : i + 1], s[: i + 1], i)]
            j = len(rows[0].slots) - num_prefilled  # the others' decode steps so far, this one too
            rows += [SeqInput([o[-1]], os[: len(o) + j], len(o) + j - 1) for o, os in beside]
            logits = self.runner.forward(rows)
        return self.kv(s), logits[0]


SCHEDULES: dict[str, Schedule] = {
    "chunks of 37": lambda p: p.chunks(37),
    "chunks of 128": lambda p: p.chunks(128),
    "batched with other prompts": lambda p: p.batched(),
    "decoded alone": lambda p: p.decoded(len(p.prompt) - 12, 0),
    "decoded beside 2 others": lambda p: p.decoded(len(p.prompt) - 12, 2),
}


def _differences(probe: _Probe) -> dict[str, str]:
    """Each schedule that does not reproduce the one-chunk prefill's bits, and how."""
    ref_kv, ref_logits = probe.one_chunk()
    out = {}
    for name, schedule in SCHEDULES.items():
        kv, logits = schedule(probe)
        if not (torch.equal(kv, ref_kv) and torch.equal(logits, ref_logits)):
            rows = int((kv != ref_kv).flatten(3).any(-1).any(0).any(0).sum())
            diff = float((logits - ref_logits).abs().max())
            out[name] = f"{rows} tokens' KV differ, logits by up to {diff:.2e}"
    return out


def _runner(model_dir: object, **kw: object) -> ModelRunner:
    cfg = EngineConfig(model=str(model_dir), max_total_tokens=16384, **kw)  # type: ignore[arg-type]
    return ModelRunner(cfg)


FORMATS = {
    "fp32": {},
    "int4": {"quantization": "int4"},
    "int8": {"quantization": "int8"},
    "fp16": {"quantization": "fp16"},
    "bf16": {"dtype": "bfloat16"},
    # KV as int8 codes and a scale per token and head (--kv-cache-dtype int8)
    "fp32, int8 KV": {"kv_cache_dtype": "int8"},
    "bf16, int8 KV": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
    "int4, int8 KV": {"quantization": "int4", "kv_cache_dtype": "int8"},
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_way_of_computing_a_prompt_gives_its_bits(tiny_llama_dir, fmt):
    runner = _runner(tiny_llama_dir, **FORMATS[fmt])
    assert runner.deterministic
    assert (runner.pool.dtype == torch.int8) == ("int8 KV" in fmt)
    # 200 tokens: past the 128 rows from which quantized formats used a dense copy, and past
    # oneDNN's 32-row bf16 blocks
    assert _differences(_Probe(runner, 200)) == {}


def test_without_determinism_the_same_schedules_differ(tiny_llama_dir):
    """The control: int4 without deterministic (a dense bf16 copy for chunks of 128 rows and
    more, SDPA for prefill rows) gives other bits on these very schedules."""
    runner = _runner(tiny_llama_dir, quantization="int4", deterministic=False)
    assert not runner.deterministic
    assert _differences(_Probe(runner, 200)) != {}


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_the_default_model_is_deterministic_on_every_schedule(smollm2_dir, quantization):
    runner = _runner(smollm2_dir, quantization=quantization)
    assert _differences(_Probe(runner, 160)) == {}


@pytest.mark.compile
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_compiled_decode_step_gives_the_eager_steps_bits(smollm2_dir, kv_cache_dtype):
    """pd serve's defaults: int4 and compiled steps for batches of 1 and 2 (a batch of one
    padded to two runs too). A prompt decoded in compiled steps writes the KV and gives the
    logits that an eager prefill of the same tokens gives (int8 KV: the step's quantizing
    and its attention are pd's ops, called from the graph)."""
    runner = _runner(
        smollm2_dir, quantization="int4", compile_buckets="1,2", kv_cache_dtype=kv_cache_dtype
    )
    assert set(runner.graphs.compile_seconds) == {1, 2}
    probe = _Probe(runner, 60)
    ref_kv, ref_logits = probe.one_chunk()
    runs = dict(runner.graphs.num_runs)
    for beside in (0, 1, 2):  # 1 and 2 rows in their buckets, 3 rows eagerly
        kv, logits = probe.decoded(48, beside)
        assert torch.equal(kv, ref_kv) and torch.equal(logits, ref_logits), beside
    assert runner.graphs.num_runs[1] > runs.get(1, 0) and runner.graphs.num_runs[2] > runs.get(2, 0)


def test_settings_that_cannot_be_deterministic_are_refused_with_what_to_change(tiny_llama_dir):
    # the linear backend is the library path's: a deterministic runner has pd's matmuls alone
    assert _runner(tiny_llama_dir, linear_backend="aten").deterministic
    with pytest.raises(ValueError, match="attention backend 'torch'.*pass --no-deterministic"):
        _runner(tiny_llama_dir, attention_backend="torch")
    with pytest.raises(ValueError, match="float16.*pass --no-deterministic"):
        _runner(tiny_llama_dir, dtype="float16")
    assert not _runner(tiny_llama_dir, linear_backend="aten", deterministic=False).deterministic
