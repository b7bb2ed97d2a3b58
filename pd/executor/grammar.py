"""Structured outputs: a request's grammar (``SamplingParams.grammar``: an llguidance grammar,
e.g. a JSON schema's) masks the tokens it may sample, wherever one is sampled.

1. The server checks the grammar before admission (``grammar_error``, without a tokenizer): a
   grammar llguidance refuses is a 400 that says why.
2. The grammar travels as text inside the request's ``SamplingParams``; each engine (colocated,
   prefill node, decode node) compiles it with its tokenizer in a ``GrammarCompiler``: off the
   engine's loop thread (llguidance drops the GIL while it builds a matcher, so the loop steps
   and beats meanwhile), once per grammar text (the ``n`` choices of a request, and requests
   with the same schema, share one compile; each request gets a copy of the compiled matcher),
   within a size budget (``max_chars``, checked before compiling) and a time budget
   (``timeout_s``). A request is not scheduled while its grammar compiles; one whose grammar
   is refused (over a budget, or llguidance's error) fails with ``GrammarRefused``, which the
   server answers with a 400.
3. ``Guide.of`` brings the request's guide up to date with its output: the decode node's guide
   consumes the prefill node's first token, so both advance the grammar over the same tokens.
   No matcher state ever travels.
4. Each step, ``Guide.fill`` writes the bitmask of the tokens the grammar allows next
   (``llguidance.LLMatcher``: EOS only where the grammar accepts, only EOS once it is
   complete); the sampler sets every other logit to -inf (``apply_masks_``).
5. Speculation: ``Guide.fill_draft`` keeps the draft's longest prefix the grammar accepts (a
   token it rejects ends the run) and writes one mask per position, as if the draft before it
   were accepted, so verification picks what plain decoding would.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import llguidance
import torch

from pd.core.request import Req

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def grammar_error(grammar: str) -> str:
    """Why llguidance cannot compile ``grammar`` ("" when it can): checked without a
    tokenizer, so the server needs none of llguidance's."""
    return llguidance.LLMatcher.validate_grammar(grammar, None)


def make_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the HF tokenizer, over the model's ``vocab_size`` (ids past the
    tokenizer's are never allowed), with the engine's EOS ids as the grammar's end. Slow
    (seconds): built once per engine, when its first guided request is sampled."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
    )


def allocate_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of ``num_rows`` rows: [num_rows, ceil(vocab_size / 32)] int32, every token
    allowed (``llguidance.torch``'s layout; that module is not imported: it compiles a kernel
    with ``torch.compile`` at import, which loads TorchDynamo and Inductor into every process
    that imports the engine, seconds of each node's start)."""
    shape = (num_rows, (vocab_size + 31) // 32)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


class GrammarRefused(ValueError):
    """A request's grammar this engine will not sample under (over a budget, or llguidance's
    error): the request's own fault, answered with a 400."""


class Guide:
    """One request's grammar matcher, kept in step with its output (only new tokens are
    consumed at each step)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher  # a compiled matcher of its own (``GrammarCompiler.poll``)
        self.num_consumed = 0  # leading output tokens the matcher has consumed
        self._check()

    @classmethod
    def of(cls, req: Req) -> Guide | None:
        """``req``'s guide, up to date with its output, or None when it has no grammar.
        ``req.guide`` was set when its grammar compiled (``GrammarCompiler.prepare``: a request
        is scheduled only then); ``GrammarRefused`` if the grammar was refused, or the output
        broke it."""
        if not req.params.grammar:
            return None
        guide = req.guide
        if isinstance(guide, GrammarRefused):
            raise guide
        assert isinstance(guide, Guide), f"{req.request_id}: sampled before its grammar compiled"
        guide.sync(req.output_ids)
        return guide

    def sync(self, output_ids: Sequence[int]) -> None:
        """Consume the output tokens past those already consumed (an output only grows); once
        the grammar is complete, what follows (EOS under ``ignore_eos``) is not its business."""
        assert len(output_ids) >= self.num_consumed, (len(output_ids), self.num_consumed)
        new = list(output_ids[self.num_consumed :])
        if new and not self.matcher.is_stopped():
            self.matcher.consume_tokens(new)
            self._check()
        self.num_consumed = len(output_ids)

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``masks[row]`` (``allocate_masks``'s rows: the
        matcher writes the row's bytes through its pointer)."""
        assert masks.dtype == torch.int32 and masks.is_cpu and masks.dim() == 2, masks.shape
        mask = masks[row]
        assert mask.is_contiguous()
        self.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())

    def fill_draft(self, draft: Sequence[int], masks: torch.Tensor, row: int) -> list[int]:
        """The longest prefix of ``draft`` the grammar accepts, n tokens; ``masks[row + i]``
        for i in 0..n: the tokens allowed after ``draft[:i]``. The matcher ends as it began."""
        num_valid = self.matcher.validate_tokens(list(draft)) if draft else 0
        kept = list(draft[:num_valid])
        for i, token in enumerate(kept):
            self.fill(masks, row + i)
            ok = self.matcher.consume_token(token)
            assert ok, f"token {token} was validated but not consumed"
        self.fill(masks, row + len(kept))
        if kept:
            self.matcher.rollback(len(kept))
        return kept

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarRefused(f"grammar: {self.matcher.get_error()}")


class _Compile:
    """One grammar's compile on a worker thread: when it started there (None: queued), and
    the requests that wait for it (weakly: a request that ended is no longer counted). Its
    future's result is None when it was skipped: no request wanted it any more."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.future: Future[llguidance.LLMatcher | None] = Future()
        self.wanted: weakref.WeakSet[Req] = weakref.WeakSet()


class GrammarCompiler:
    """Compiles grammars on ``num_threads`` worker threads, never on the caller's (an
    engine's loop thread), and keeps the last results (compiled matchers and refusals) by
    grammar text: at most ``cache_size`` of them, of at most ``max_cached_chars`` characters of
    grammar together (the newest always kept: its request's other choices take it next). A
    compiled matcher's memory follows its grammar's text (llguidance's lexer and parser are
    built from it; ~8 MiB for a schema of 128k characters), so a count alone let 16 large
    grammars hold ~130 MiB; characters bound it by what was sent.

    ``warm`` builds llguidance's tokenizer on the worker, at once: a node waits for it before it
    says where to reach it, so its memory (~80 MiB with the HF tokenizer it is made from) is
    part of the node's start, not a step minutes into its life at its first guided request.

    Budgets: a grammar longer than ``max_chars`` is refused before it compiles; one that takes
    longer than ``timeout_s`` on its worker is refused at that deadline. llguidance cannot be
    interrupted: its worker finishes the build (bounded by llguidance's own fuel limits) and
    the result is dropped. The worker threads are a fixed pool, so a flood of grammars queues
    (each waiting request holds its place on the node, bounded by the node's queues) and never
    piles up threads; a queued grammar's clock starts when its worker takes it, and one that
    no live request waits for any more (they were aborted) is skipped."""

    def __init__(
        self,
        tokenizer: Callable[[], llguidance.LLTokenizer],
        max_chars: int,
        timeout_s: float,
        num_threads: int = 1,
        cache_size: int = 16,
        max_cached_chars: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer  # built on a worker, the first time one compiles
        self._tokenizer_lock = threading.Lock()
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        # the workers start now, with the engine, so that a node's threads are as many before
        # its first grammar as after (the chaos soak counts them against the idle node's)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        for _ in range(num_threads):
            self._pool.submit(time.sleep, 0.05)  # each submit while none is idle starts one
        self._cache_size = cache_size
        # two grammars at the size budget, or many small ones
        self.max_cached_chars = 2 * max_chars if max_cached_chars is None else max_cached_chars
        self._done: OrderedDict[str, llguidance.LLMatcher | GrammarRefused] = OrderedDict()
        self.num_cached_chars = 0  # of the grammars in ``_done``
        self._compiling: dict[str, _Compile] = {}
        self.num_compiled = 0  # compiles started (a cached grammar starts none)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def prepare(self, req: Req) -> bool:
        """Whether ``req`` may be scheduled: it has no grammar, or its guide is set
        (``req.guide``: a ``Guide``, or the ``GrammarRefused`` its sampling fails with).
        False while its grammar compiles (the compile starts at the first call)."""
        if not req.params.grammar or req.guide is not None:
            return True
        result = self.poll(req.params.grammar, req)
        if result is None:
            return False
        try:
            req.guide = result if isinstance(result, GrammarRefused) else Guide(result.deep_copy())
        except GrammarRefused as e:
            req.guide = e
        return True

    def poll(self, grammar: str, req: Req) -> llguidance.LLMatcher | GrammarRefused | None:
        """The compiled matcher of ``grammar`` (shared: copy it), its refusal, or None while it
        compiles for ``req`` (and the others that wait for it; started here if it is not
        compiling yet)."""
        done = self._done.get(grammar)
        if done is not None:
            self._done.move_to_end(grammar)
            return done
        job = self._compiling.get(grammar)
        if job is not None and job.future.done():
            del self._compiling[grammar]
            error = job.future.exception()
            if error is not None:
                return self._finish(grammar, GrammarRefused(f"grammar: {error}"))
            if (matcher := job.future.result()) is not None:
                return self._finish(grammar, matcher)
            job = None  # skipped while no request wanted it: wanted again now
        if job is None:
            if len(grammar) > self.max_chars:
                return self._finish(
                    grammar,
                    GrammarRefused(
                        f"the grammar is {len(grammar)} characters; this engine compiles "
                        f"grammars of at most {self.max_chars} (--max-grammar-chars)"
                    ),
                )
            self._compiling[grammar] = job = _Compile()
            job.wanted.add(req)
            self._start(grammar, job)
            return None
        job.wanted.add(req)
        if job.started is not None and time.monotonic() - job.started > self.timeout_s:
            del self._compiling[grammar]  # its worker finishes it, and the result is dropped
            return self._finish(
                grammar,
                GrammarRefused(
                    f"the grammar did not compile within {self.timeout_s:g} s "
                    "(--grammar-timeout-s): send a smaller or simpler one"
                ),
            )
        return None

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a compile to end (an engine with nothing else to do)."""
        futures = [job.future for job in self._compiling.values()]
        if futures:
            wait(futures, timeout_s, FIRST_COMPLETED)

    def warm(self) -> Future[llguidance.LLTokenizer]:
        """Build llguidance's tokenizer now, on the worker (the first compile would); done when
        it is built (its error, if it cannot be, is the first compile's again)."""
        return self._pool.submit(self._llg_tokenizer)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, grammar: str, job: _Compile) -> None:
        self.num_compiled += 1

        def compile_() -> None:
            if not job.wanted:  # every request that asked for it ended while it queued
                job.future.set_result(None)
                return
            try:
                tokenizer = self._llg_tokenizer()  # the engine's, not the grammar's, time
                job.started = time.monotonic()
                matcher = llguidance.LLMatcher(tokenizer, grammar)
                if matcher.is_error():
                    raise ValueError(matcher.get_error())
                job.future.set_result(matcher)
            except Exception as e:  # handed to ``poll``
                job.future.set_exception(e)

        self._pool.submit(compile_)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # built once, by the first worker that needs it
            return self._tokenizer()

    def _finish(
        self, grammar: str, result: llguidance.LLMatcher | GrammarRefused
    ) -> llguidance.LLMatcher | GrammarRefused:
        self._done[grammar] = result
        self.num_cached_chars += len(grammar)
        while len(self._done) > 1 and (
            len(self._done) > self._cache_size or self.num_cached_chars > self.max_cached_chars
        ):
            self.num_cached_chars -= len(self._done.popitem(last=False)[0])
        return result


_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks_(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of logits [n, vocab] float32 that masks
    [n, ceil(vocab / 32)] int32 does not allow (bit j of word w: token 32 w + j). Eager (not
    llguidance's torch.compile'd kernel: no compile on a request's path)."""
    num_rows, vocab = logits.shape
    assert masks.shape == (num_rows, (vocab + 31) // 32), (masks.shape, logits.shape)
    masks = masks.to(logits.device)
    # allowed: [n, 32 * words] -> [n, vocab]
    allowed = ((masks[:, :, None] >> _BITS.to(logits.device)) & 1).reshape(num_rows, -1)
    logits.masked_fill_(allowed[:, :vocab] == 0, float("-inf"))
