"""Seeded, reproducible workloads for a simulated fleet (:mod:`bench.fleet.fleet`), with
open-loop (Poisson) arrivals.

* :func:`many_adapters`: requests for ``adapters`` LoRA adapters whose popularity follows
  Zipf's law (the k-th most popular is asked for in proportion to 1/k^s), each prompt its
  own (no shared prefix).
* :class:`Sessions`: multi-turn conversations: each starts with its tenant's system prompt;
  every turn resends the history (the earlier turns' user messages and answers) plus a new
  user message, a think time after the last answer. Conversations arrive at a Poisson rate.
* :func:`tenants`: one heavy tenant sending more than the fleet can serve and light tenants
  at a trickle.

Output lengths are uniform in ``max_tokens`` (32 to 224 by default, mean 128; requests run
with ``ignore_eos``): with one length for all, requests that start in one step end in one
step, and the whole fleet frees its slots in waves, which no real traffic does.

Token ids stand for text: a prompt's text (what the replica router hashes) is its ids as
4-hex-digit words, so a shared prefix of tokens is a shared prefix of text and a block of
``block_chars`` 128 is 32 tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.fleet.fleet import FleetRequest
from serve_app.sim.prefix_cache import PrefixCache

VOCAB = 65_536


def as_text(ids: tuple[int, ...]) -> str:
    """The text a prompt of token ``ids`` stands for (4 hex digits a token)."""
    return "".join(f"{t:04x}" for t in ids)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def next_turn(done: FleetRequest, rng: random.Random, user_tokens: int) -> tuple[int, ...]:
    """The prompt of a conversation's next turn: ``done``'s prompt, its answer (the tokens it
    generated, as a chat client resends them) and a new user message of ``user_tokens``
    (token ids drawn from ``rng``)."""
    return done.prompt_ids + done.output_ids + _tokens(rng, user_tokens)


def poisson_times(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` per s over ``duration_s``."""
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


#: Output lengths, tokens: (least, most), uniform.
MAX_TOKENS = (32, 224)
#: A many-adapters or tenants request's prompt, tokens.
PROMPT_TOKENS = 256


def many_adapters(rate: float, duration_s: float, *, adapters: int = 1000,
                  zipf_s: float = 1.0, prompt_tokens: int = PROMPT_TOKENS,
                  max_tokens: tuple[int, int] = MAX_TOKENS, seed: int = 0
                  ) -> list[FleetRequest]:
    """Requests at ``rate``/s for ``duration_s`` s, each for adapter ``lora-<k>@v1`` with k
    drawn from Zipf(``zipf_s``) over ``adapters``."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** zipf_s for k in range(adapters)]
    times = poisson_times(rng, rate, duration_s)
    picks = rng.choices(range(adapters), weights=weights, k=len(times))
    out = []
    for t, k in zip(times, picks):
        ids = _tokens(rng, prompt_tokens)
        out.append(FleetRequest(t, ids, rng.randint(*max_tokens), as_text(ids),
                                adapter=f"lora-{k}@v1"))
    return out


def adapter_rank(adapter: str) -> int:
    """The popularity rank of a :func:`many_adapters` adapter (``lora-<k>@v1``: k, 0 the most
    popular)."""
    return int(adapter.removeprefix("lora-").partition("@")[0])


@dataclass
class Sessions:
    """Conversations arriving at ``rate`` per s for ``duration_s`` s (see the module
    docstring); ``requests()`` gives their first turns, ``follow_up`` the next turn of one
    that finished (for :meth:`Fleet.run`)."""

    rate: float
    duration_s: float
    tenants: int = 16
    system_tokens: int = 512
    user_tokens: int = 64
    max_tokens: tuple[int, int] = MAX_TOKENS
    turns: tuple[int, int] = (3, 8)
    think_s: float = 3.0
    seed: int = 0
    _left: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.system = [_tokens(self.rng, self.system_tokens) for _ in range(self.tenants)]

    def requests(self) -> list[FleetRequest]:
        out = []
        for i, t in enumerate(poisson_times(self.rng, self.rate, self.duration_s)):
            session = f"conv-{i}"
            self._left[session] = self.rng.randint(*self.turns) - 1
            ids = self.system[self.rng.randrange(self.tenants)] + _tokens(self.rng,
                                                                         self.user_tokens)
            out.append(FleetRequest(t, ids, self.rng.randint(*self.max_tokens), as_text(ids),
                                    session=session))
        return out

    def follow_up(self, done: FleetRequest) -> FleetRequest | None:
        if not self._left.get(done.session):
            return None
        self._left[done.session] -= 1
        rng = random.Random(f"{self.seed}/{done.session}/{len(done.prompt_ids)}")
        ids = next_turn(done, rng, self.user_tokens)
        return FleetRequest(done.done_at + rng.expovariate(1 / self.think_s), ids,
                            rng.randint(*self.max_tokens), as_text(ids), session=done.session)

    def mean_turns(self) -> float:
        return sum(self.turns) / 2


def tenants(heavy_rate: float, light_rate: float, duration_s: float, *, light: int = 7,
            prompt_tokens: int = PROMPT_TOKENS, max_tokens: tuple[int, int] = MAX_TOKENS, seed: int = 0
            ) -> list[FleetRequest]:
    """Tenant ``heavy`` at ``heavy_rate``/s and ``light`` tenants ``light-<i>`` at
    ``light_rate``/s each, for ``duration_s`` s (a ``heavy_rate`` of 0 gives the light
    tenants alone: their idle figures)."""
    rng = random.Random(seed)
    out = []
    for tenant, rate in [("heavy", heavy_rate)] + [(f"light-{i}", light_rate)
                                                    for i in range(light)]:
        for t in poisson_times(rng, rate, duration_s) if rate > 0 else []:
            ids = _tokens(rng, prompt_tokens)
            out.append(FleetRequest(t, ids, rng.randint(*max_tokens), as_text(ids),
                                    tenant=tenant))
    return sorted(out, key=lambda r: r.arrival)


def reachable_hit_rate(requests: list[FleetRequest], block_size: int,
                       measured_from: float = 0.0) -> float:
    """Share of the prompt tokens of ``requests`` arriving from ``measured_from`` (s) on that
    a single engine with an unbounded prefix cache would find cached (every request in
    arrival order, whole blocks, per adapter; a served request's answer cached after its
    prompt, as the engine caches it): the most any routing can get from this workload."""
    cache = PrefixCache(10**12, block_size)
    lora = {}
    hits = total = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        key = lora.setdefault(r.adapter, len(lora)) if r.adapter else 0
        cached = cache.insert(r.prompt_ids, key)
        if r.arrival >= measured_from:
            hits, total = hits + cached, total + len(r.prompt_ids)
        if r.output_ids:
            cache.insert_finished(r.prompt_ids, r.output_ids, key)
    return hits / total if total else 0.0


@dataclass
class ClosedLoop:
    """The load of the mesh's own benchmarks (``bench.loadgen``): ``total``
    requests, ``clients`` in flight, each client sending its next request when its last one
    ends; request i asks for ``adapters[i % len(adapters)]`` (None: the base model). One
    prompt of ``prompt_tokens`` for all, as the load generator sends."""

    total: int
    clients: int
    prompt_tokens: int
    max_tokens: int
    adapters: tuple[str | None, ...] = (None,)

    def __post_init__(self) -> None:
        self._sent = 0
        self.prompt = _tokens(random.Random(0), self.prompt_tokens)

    def _next(self, at: float) -> FleetRequest | None:
        if self._sent >= self.total:
            return None
        adapter = self.adapters[self._sent % len(self.adapters)]
        self._sent += 1
        return FleetRequest(at, self.prompt, self.max_tokens, as_text(self.prompt),
                            adapter=adapter)

    def requests(self) -> list[FleetRequest]:
        return [r for r in (self._next(0.0) for _ in range(self.clients)) if r]

    def follow_up(self, done: FleetRequest) -> FleetRequest | None:
        return self._next(done.done_at)


@dataclass
class SessionQueue:
    """``bench.py --sessions``' load, replayed: session ``s`` sends ``prompts[s][t]`` (token
    ids, as that benchmark's chat template renders them) at turn ``t``; ``in_flight``
    requests at once, taking turns first come first served (a session that finishes a turn
    queues its next behind the others)."""

    prompts: list[list[tuple[int, ...]]]
    in_flight: int
    max_tokens: int

    def __post_init__(self) -> None:
        self._queue = [self._turn(s, 0) for s in range(len(self.prompts))]

    def _turn(self, s: int, t: int) -> FleetRequest:
        ids = self.prompts[s][t]
        return FleetRequest(0.0, ids, self.max_tokens, as_text(ids), session=f"s{s}")

    def turn(self, request: FleetRequest) -> int:
        """Which turn of its session ``request`` is (0: the first)."""
        return self.prompts[int(request.session[1:])].index(tuple(request.prompt_ids))

    def requests(self) -> list[FleetRequest]:
        first, self._queue = self._queue[:self.in_flight], self._queue[self.in_flight:]
        return first

    def follow_up(self, done: FleetRequest) -> FleetRequest | None:
        s, t = int(done.session[1:]), self.turn(done)
        if t + 1 < len(self.prompts[s]):
            self._queue.append(self._turn(s, t + 1))
        if not self._queue:
            return None
        nxt = self._queue.pop(0)
        nxt.arrival = done.done_at
        return nxt
