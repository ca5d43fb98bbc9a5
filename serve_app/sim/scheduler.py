"""The simulated engine's scheduler: continuous batching under vLLM's limits, priced by a
profile. Pure (no asyncio, no clock): :class:`~serve_app.sim.core.SimEngineCore` calls
:meth:`SimScheduler.plan`, waits the step's seconds, then calls :meth:`SimScheduler.finish`.

What it honours, as vLLM's v1 scheduler does:

* ``max_num_seqs`` sequences run at once; the rest wait;
* ``max_loras`` distinct adapters per batch: a waiting request for another adapter is
  skipped (a later one may go first), not blocking the queue;
* the waiting order: FIFO, or with ``scheduling_policy: priority`` the lowest ``priority``
  value first (arrival order among equals);
* ``max_num_batched_tokens`` uncached prompt tokens prefilled per step (the first admitted
  request always goes);
* the prefix cache: a request's leading cached blocks are not prefilled, and a finished
  request's full blocks of prompt and output are cached (vLLM caches a sequence's blocks as
  they fill, generated tokens included, so a next turn that resends the answer hits it);
* stopping: EOS (unless ``ignore_eos``, and not before ``min_tokens``), ``stop_token_ids``,
  ``max_tokens``, and ``max_model_len``.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

from serve_app.sim.answers import AnswerBook
from serve_app.sim.prefix_cache import PrefixCache
from serve_app.common.sim_profile import SimProfile

#: ``finish_reason`` values, as vLLM's ``FinishReason`` names them.
STOP, LENGTH = "stop", "length"


@dataclass
class SimRequest:
    """One sequence in the simulated engine (times on the engine's monotonic clock, s)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    label: str  # who answers (:mod:`serve_app.sim.answers`)
    lora: int = 0  # vLLM's lora_int_id, 0 for none
    lora_name: str = ""
    priority: int = 0
    eos: int | None = None  # None: ignore_eos
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs asked for (vLLM's ``logprobs``)
    arrival: float = 0.0
    seq: int = 0  # arrival order
    scheduled_at: float | None = None
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # the tokens generated so far
    answer: list[int] = field(default_factory=list)  # the natural answer, EOS last

    @property
    def generated(self) -> int:
        """Tokens generated so far."""
        return len(self.output_ids)


@dataclass(frozen=True)
class Step:
    """One planned engine step: its length (s) and the requests it admits."""

    seconds: float
    admitted: tuple[SimRequest, ...]
    batch: int
    adapters: int
    prefill_tokens: int


@dataclass(frozen=True)
class Token:
    """A token a step produced for a request; ``finish`` is None while it runs on."""

    request: SimRequest
    token_id: int
    first: bool
    finish: str | None
    stop_reason: int | None = None


def evict_idle_lru(loras: OrderedDict, keep: int, in_use: Collection[Hashable]) -> None:
    """Drop the least recently used entries of ``loras`` (adapter -> anything, least recent
    first) whose adapter is not ``in_use`` until at most ``keep`` remain, as vLLM's LRU
    adapter cache does; adapters in use are never dropped (then more may remain)."""
    while len(loras) > keep:
        victim = next((key for key in loras if key not in in_use), None)
        if victim is None:
            break
        del loras[victim]


class SimScheduler:
    """Continuous batching of :class:`SimRequest` s, priced by ``profile``.

    Args:
        profile: the cost model.
        book: the deterministic answers.
        max_num_seqs, max_loras, max_model_len, max_num_batched_tokens: the engine's limits.
        priority: ``scheduling_policy: priority``.
        step_jitter: draws each step's time around its price (the profile's
            ``step_time_cv``); None: every step exactly as priced (the Serve sim engine, on
            the wall clock, whose own noise is real).
    """

    def __init__(self, profile: SimProfile, book: AnswerBook, *, max_num_seqs: int,
                 max_loras: int, max_model_len: int, max_num_batched_tokens: int,
                 priority: bool = False, step_jitter: random.Random | None = None) -> None:
        self.profile = profile
        self.book = book
        self.max_num_seqs = max_num_seqs
        self.max_loras = max(max_loras, 1)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority = priority
        self.step_jitter = step_jitter
        self.waiting: list[SimRequest] = []
        self.running: dict[str, SimRequest] = {}
        self.cache = PrefixCache(profile.kv_blocks, profile.block_size)
        self._seq = itertools.count()

    # -- requests ----------------------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        request.seq = next(self._seq)
        request.answer = self.book.answer(request.label, request.prompt_ids)
        self.waiting.append(request)

    def abort(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self.waiting = [r for r in self.waiting if r.request_id not in gone]
        for rid in gone:
            self.running.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def loras_in_use(self) -> set[int]:
        """Adapters (lora_int_id) that a waiting or running request uses."""
        return {r.lora for r in (*self.waiting, *self.running.values()) if r.lora}

    # -- one step ----------------------------------------------------------------------------

    def plan(self, now: float) -> Step:
        """Admit what fits this step and price it (:meth:`SimProfile.step_s`)."""
        order = (sorted(self.waiting, key=lambda r: (r.priority, r.seq)) if self.priority
                 else list(self.waiting))
        loras = {r.lora for r in self.running.values() if r.lora}
        admitted: list[SimRequest] = []
        prefill = lora_prefill = 0
        lengths: list[int] = []
        cached: list[int] = []
        for req in order:
            if len(self.running) >= self.max_num_seqs:
                break
            if req.lora and req.lora not in loras and len(loras) >= self.max_loras:
                continue  # another adapter would pass max_loras: a later request may fit
            uncached = len(req.prompt_ids) - self.cache.lookup(req.prompt_ids, req.lora)
            if admitted and prefill + uncached > self.max_num_batched_tokens:
                break
            req.cached_tokens = self.cache.insert(req.prompt_ids, req.lora)
            req.scheduled_at = now
            prefill += uncached
            lengths.append(uncached)
            cached.append(req.cached_tokens)
            lora_prefill += uncached if req.lora else 0
            admitted.append(req)
            self.running[req.request_id] = req
            if req.lora:
                loras.add(req.lora)
        if admitted:
            taken = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        batch = len(self.running)
        seconds = self.profile.step_s(batch=batch, prefill_tokens=prefill, adapters=len(loras),
                                      prefill_lengths=lengths, prefill_cached=cached,
                                      lora_prefill_tokens=lora_prefill)
        if self.step_jitter is not None:
            seconds *= self.profile.step_factor(self.step_jitter)
        return Step(seconds, tuple(admitted), batch, len(loras), prefill)

    def finish(self, step: Step) -> list[Token]:
        """One token for every request still running after ``step``; finished ones leave,
        their blocks cached up to the last token (the one whose KV no step computed)."""
        first = {id(r) for r in step.admitted}
        tokens = []
        for req in list(self.running.values()):
            token_id = self._next_token(req)
            req.output_ids.append(token_id)
            finish, stop_reason = self._stop(req, token_id)
            tokens.append(Token(req, token_id, id(req) in first, finish, stop_reason))
            if finish:
                del self.running[req.request_id]
                self.cache.insert_finished(req.prompt_ids, req.output_ids, req.lora)
        return tokens

    def _next_token(self, req: SimRequest) -> int:
        i = req.generated
        natural_end = len(req.answer) - 1  # where the EOS stands
        if req.eos is not None and i == max(natural_end, req.min_tokens):
            return req.eos
        if i < natural_end:
            return req.answer[i]
        return self.book.token_at(req.label, req.prompt_ids, i)

    def _stop(self, req: SimRequest, token_id: int) -> tuple[str | None, int | None]:
        # vLLM's check_stop order (vllm/v1/core/sched/utils.py)
        if req.eos is not None and token_id == req.eos:
            return STOP, None
        if token_id in req.stop_ids:
            return STOP, token_id
        if (len(req.prompt_ids) + req.generated >= self.max_model_len
                or req.generated >= req.max_tokens):
            return LENGTH, None
        return None, None

    # -- what the engine reports -------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        """Share of KV blocks the running sequences hold (0..1)."""
        size = self.profile.block_size
        used = sum(-(-(len(r.prompt_ids) + r.generated) // size) for r in self.running.values())
        return min(used / self.profile.kv_blocks, 1.0)
