"""Grammars compile off the engine's thread (``pd.executor.grammar.GrammarCompiler``), once per
grammar text, within a size and a time budget, on a tiny random checkpoint (SmolLM2's
tokenizer).

The compile is made slow by a stand-in for ``llguidance.LLMatcher`` that waits for the test to
let it go (``_Gate``): the engine keeps stepping its other requests meanwhile, and the guided
request runs once its grammar is in.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from pathlib import Path

import llguidance
import pytest
import torch

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor import grammar as grammar_mod
from pd.executor.config import EngineConfig

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    POINT, defaults={"whitespace_flexible": False}
)
YES_NO = llguidance.LLMatcher.grammar_from_regex("(yes|no)")
_REAL_MATCHER = llguidance.LLMatcher


class _Gate:
    """Stands in for ``llguidance.LLMatcher``: each build waits (at most ``max_wait_s``) until
    ``open()``, and records the thread it ran on."""

    def __init__(self, max_wait_s: float = 30.0) -> None:
        self._open = threading.Event()
        self.max_wait_s = max_wait_s
        self.threads: list[threading.Thread] = []

    def __call__(self, tokenizer: object, grammar: str, **kw: object) -> object:
        self.threads.append(threading.current_thread())
        self._open.wait(self.max_wait_s)
        return _REAL_MATCHER(tokenizer, grammar, **kw)

    def open(self) -> None:
        self._open.set()

    # what the code under test reads of the class besides building one
    validate_grammar = staticmethod(_REAL_MATCHER.validate_grammar)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> _Gate:
    gate = _Gate()
    monkeypatch.setattr(grammar_mod.llguidance, "LLMatcher", gate)
    yield gate
    gate.open()  # a worker still waiting ends


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_total_tokens=4096, **kw))


def _prompt(seed: int, vocab: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def _run(engine: Engine, until: set[str], max_steps: int = 10_000) -> dict[str, list]:
    """Step until every request in ``until`` finished; each request's outputs."""
    outs: dict[str, list] = {}
    done: set[str] = set()
    for _ in range(max_steps):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.finished:
                done.add(out.request_id)
        if until <= done:
            return outs
    raise AssertionError(f"not finished after {max_steps} steps: {until - done}")


def test_the_engine_steps_on_while_a_grammar_compiles_and_n_choices_compile_once(
    tiny_llama_dir, gate: _Gate
) -> None:
    engine = _engine(tiny_llama_dir)
    vocab = engine.runner.model_config.vocab_size
    guided = SamplingParams(max_tokens=8, temperature=1.0, seed=3, grammar=GRAMMAR)
    choices = [engine.add_request(_prompt(0, vocab), guided) for _ in range(16)]  # n=16
    plain = engine.add_request(_prompt(1, vocab), SamplingParams(max_tokens=6, ignore_eos=True))

    # the compile waits for the gate: the plain request runs to its end meanwhile
    outs = _run(engine, {plain})
    assert sum(len(o.new_token_ids) for o in outs[plain]) == 6
    assert not set(choices) & set(outs), "a guided request ran before its grammar compiled"
    assert engine.core.grammars.num_compiling == 1
    deadline = time.monotonic() + 60  # the worker builds llguidance's tokenizer first
    while not gate.threads:
        assert time.monotonic() < deadline, "the compile never started"
        time.sleep(0.05)
    assert threading.current_thread() not in gate.threads
    for _ in range(3):  # held at the gate: the guided requests still wait, unscheduled
        assert not engine.step()

    gate.open()
    outs = _run(engine, set(choices))
    for rid in choices:
        assert outs[rid][-1].error is None, outs[rid][-1]
        text = engine.tokenizer.decode(sum((o.new_token_ids for o in outs[rid]), []))
        assert text.startswith('{"x":'), text
    assert len(gate.threads) == 1, "the 16 choices' one grammar compiled more than once"
    assert engine.core.grammars.num_compiled == 1
    engine.check_integrity()
    engine.close()


def test_a_grammar_over_the_time_budget_is_refused_and_the_engine_goes_on(
    tiny_llama_dir, gate: _Gate
) -> None:
    engine = _engine(tiny_llama_dir, grammar_timeout_s=0.2)
    vocab = engine.runner.model_config.vocab_size
    slow = SamplingParams(max_tokens=8, grammar=GRAMMAR)
    first = engine.add_request(_prompt(0, vocab), slow)
    plain = engine.add_request(_prompt(1, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
    outs = _run(engine, {first, plain})
    (last,) = [o for o in outs[first] if o.finished]
    assert last.is_refused and "did not compile within 0.2 s" in last.error, last
    assert not any(o.new_token_ids for o in outs[first])
    assert sum(len(o.new_token_ids) for o in outs[plain]) == 4
    # the same grammar again is refused from the cache, without a second compile
    again = engine.add_request(_prompt(2, vocab), slow)
    (out,) = _run(engine, {again})[again]
    assert out.is_refused and "did not compile" in out.error
    assert len(gate.threads) == 1
    gate.open()  # the abandoned build ends on its worker; its result is dropped
    engine.check_integrity()
    engine.close()


def test_a_grammar_over_the_size_budget_is_refused_before_it_compiles(
    tiny_llama_dir, gate: _Gate
) -> None:
    engine = _engine(tiny_llama_dir, max_grammar_chars=len(GRAMMAR) - 1)
    vocab = engine.runner.model_config.vocab_size
    rid = engine.add_request(_prompt(0, vocab), SamplingParams(max_tokens=4, grammar=GRAMMAR))
    (out,) = _run(engine, {rid})[rid]
    assert out.is_refused, out
    assert f"{len(GRAMMAR)} characters" in out.error and f"at most {len(GRAMMAR) - 1}" in out.error
    assert gate.threads == [] and engine.core.grammars.num_compiled == 0
    engine.check_integrity()
    engine.close()


def test_a_queued_grammar_whose_requests_were_aborted_is_skipped(
    tiny_llama_dir, gate: _Gate
) -> None:
    """One worker: grammar A compiles (held at the gate) while B (``YES_NO``) queues; B's only
    request is aborted, so B is skipped when the worker gets to it; a later request with B
    compiles it."""
    engine = _engine(tiny_llama_dir)
    vocab = engine.runner.model_config.vocab_size
    first = engine.add_request(_prompt(0, vocab), SamplingParams(max_tokens=4, grammar=GRAMMAR))
    gone = engine.add_request(_prompt(1, vocab), SamplingParams(max_tokens=4, grammar=YES_NO))
    assert engine.core.grammars.num_compiling == 2
    engine.abort(gone)
    gc.collect()  # the aborted request is gone: nothing waits for B any more
    gate.open()
    _run(engine, {first})
    assert len(gate.threads) == 1, "the compile no request waited for ran"
    again = engine.add_request(_prompt(2, vocab), SamplingParams(max_tokens=3, grammar=YES_NO))
    outs = _run(engine, {again})[again]
    assert outs[-1].error is None and len(gate.threads) == 2
    engine.check_integrity()
    engine.close()


def test_importing_the_engine_and_the_server_loads_no_inductor() -> None:
    """Every node, ``pd serve`` and TP rank process imports the engine: ``llguidance.torch``
    compiles a kernel with ``torch.compile`` when it is imported, which loads Inductor and
    Dynamo (a second of CPU time a process), and so did the compile cache's import of
    Inductor's cache helper; pd writes the masks itself and loads Inductor only to compile or
    load its decode steps, when asked. Checked in a fresh interpreter."""
    code = (
        "import sys, pd.fleet.node_actor, pd.cli.serve, pd.parallel.main; "
        "print(sorted({'torch._dynamo', 'torch._inductor', 'llguidance.torch'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout[-2000:]


def test_an_eager_engine_of_a_mixture_of_experts_loads_no_dynamo(family_dir) -> None:
    """A prefill node (and any engine without compiled steps) builds its model, a mixture of
    experts' too, without importing torch._dynamo (seconds of CPU a process): the experts'
    block is kept out of torch.compile where a step is compiled, not by a decorator."""
    model = family_dir("qwen3_moe")
    code = (
        "import sys\n"
        "from pd.engine.engine import Engine\n"
        "from pd.executor.config import EngineConfig\n"
        "from pd.core.sampling_params import SamplingParams\n"
        f"engine = Engine(EngineConfig(model={str(model)!r}, max_total_tokens=256))\n"
        "assert engine.runner.model.has_moe\n"
        "engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))\n"
        "print(sorted({'torch._dynamo', 'torch._inductor'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
