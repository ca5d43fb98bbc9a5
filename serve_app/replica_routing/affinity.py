"""Which replica of a variant serves a request: prefix and session affinity under a load bound.

vLLM's automatic prefix caching keeps the KV blocks of the prompts an engine has computed; a
request that starts like an earlier one reuses them, but only on the replica that served the
earlier one. Serve's default router (power of two choices on queue length) ignores content,
so with N replicas a tenant's system prompt or a conversation's history is computed and
cached N times. This module is the pure decision; :mod:`serve_app.replica_routing.router`
plugs it into Serve's request-router API. docs/replica-routing.md states the rules in full
and what each one buys.

Keys (:func:`prefix_keys`): the prompt's text cut into blocks of ``block_chars`` characters;
a block's key hashes all the text up to its end, seeded with the adapter, as vLLM's block
hashes chain and carry the LoRA (a block cached under one adapter is no hit for another).

Rules, in order, for the replicas Serve offers (``loads``: requests in flight on each), each
a :data:`Decision`:

1. ``session``: a session seen before goes back to the replica that served it last;
2. ``hit``: the replicas holding the longest run of the prompt's leading blocks, if it covers
   at least ``min_match_rate`` of them (so a tenant's conversations that share only its
   system prompt spread instead of following one replica);
3. ``adapter``: for a LoRA request, the replicas holding its adapter resident, those with a
   LoRA batch slot for it (fewer than ``max_loras`` adapters in flight) first, so batches mix
   few adapters and a request seldom waits for a load;
4. ``spill``: a preferred replica is kept only while its load is at most ``imbalance_bound``
   (``adapter_imbalance_bound`` for rule 3: a spilled adapter costs a load) above the least
   loaded replica's; past it the request goes there, so a hot prefix or adapter spreads;
5. ``new``: nothing held: the least-loaded replica holding the fewest blocks and sessions
   (a cold adapter: the least-loaded with a LoRA batch slot for it), ties broken by
   rendezvous hashing so routers agree;
6. ``newcomer``: a base-model request admission started in a newcomer slot
   (:mod:`serve_app.admission.fair_share`) goes to a replica with an engine seat free, the
   one sent a request least recently, where the last prefill is likeliest over.

Each router process learns from what it routes (no shared state, no call on the request
path); a replica that leaves loses only its own entries. Entries are kept LRU, at most
``max_blocks`` block keys and ``max_sessions`` sessions per router; a session is a
fixed-size digest (:func:`serve_app.request.planner.conversation`), so the table's memory is
bounded by those counts whatever the clients' session ids.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.common.adapters import adapter_name

Decision = Literal["session", "hit", "adapter", "spill", "new", "newcomer"]

#: Defaults (request_router_kwargs override them): 128 characters are ~40 tokens of English.
BLOCK_CHARS = 128
IMBALANCE_BOUND = 4  # requests in flight
MIN_MATCH_RATE = 0.5  # of the prompt's blocks
#: The adapter bound for a replica that reported no ``max_num_seqs`` (the demo engines').
ADAPTER_IMBALANCE_BOUND = 8  # requests in flight
MAX_BLOCKS = 200_000  # block keys per router process (~30 MB at most)
MAX_SESSIONS = 100_000
MAX_ADAPTER_ROUTES = 10_000  # (adapter, replica) pairs remembered since the replicas' reports


def _text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, or the string ``text`` of its
    parts (or string parts); anything else in it, of any JSON type, adds nothing (vLLM
    answers a malformed body with its 400; the router must not raise on it first)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else p.get("text") if isinstance(p, dict)
                       and isinstance(p.get("text"), str) else "" for p in content)
    return ""


def prompt_text(endpoint: str, body: Mapping[str, Any]) -> str:
    """The text a request's prompt starts with: for ``"chat"`` each message as
    ``role: text`` on its own line, for ``"completion"`` the ``prompt`` (its first item when
    it is a list). An unusable body, or part of one, gives ``""`` (no affinity; vLLM answers
    it): any JSON shape is read without raising."""
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"{_text(m.get('role'))}: {_text(m.get('content'))}\n"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else ""


def prefix_keys(text: str, adapter: str | None = None, block_chars: int = BLOCK_CHARS
                ) -> list[bytes]:
    """Chained keys of ``text``'s whole blocks: key ``i`` identifies the first
    ``(i + 1) * block_chars`` characters under ``adapter``. 8-byte BLAKE2b digests."""
    h = hashlib.blake2b(f"{adapter or ''}\0".encode("utf-8", "surrogatepass"),
                        digest_size=8)
    keys = []
    for end in range(block_chars, len(text) + 1, block_chars):
        h.update(text[end - block_chars:end].encode("utf-8", "surrogatepass"))
        keys.append(h.copy().digest())
    return keys


@dataclass(frozen=True)
class Choice:
    """A routing decision: ``ranks`` of replica ids, most preferred first (Serve tries each
    rank in turn and takes its least-loaded replica that has room), and why."""

    ranks: list[list[Hashable]]
    decision: Decision


def _rendezvous(key: bytes, replica: Hashable) -> bytes:
    return hashlib.blake2b(key + str(replica).encode(), digest_size=8).digest()


class ReplicaAffinity:
    """The affinity table of one router process for one variant (see the module docstring).

    Args:
        imbalance_bound: requests in flight a preferred replica may carry above the
            least-loaded one before a request spills (>= 0).
        max_blocks, max_sessions: LRU bounds of the table.
        adapter_imbalance_bound: the same bound for a replica preferred only because it
            holds the request's adapter (>= 0); None: that replica's ``max_num_seqs`` as
            reported (:meth:`choose`), else :data:`ADAPTER_IMBALANCE_BOUND`.
        min_match_rate: the share of a prompt's blocks a held run must cover to count as a
            prefix hit (0 to 1; 0: any held block).

    Raises:
        ValueError: a negative bound, an LRU bound below 1, or a rate outside [0, 1].
    """

    def __init__(self, imbalance_bound: int = IMBALANCE_BOUND, max_blocks: int = MAX_BLOCKS,
                 max_sessions: int = MAX_SESSIONS,
                 adapter_imbalance_bound: int | None = None,
                 min_match_rate: float = MIN_MATCH_RATE) -> None:
        if min(imbalance_bound, adapter_imbalance_bound or 0) < 0 or max_blocks < 1 \
                or max_sessions < 1 or not 0 <= min_match_rate <= 1:
            raise ValueError("imbalance_bound and adapter_imbalance_bound must be >= 0, "
                             "max_blocks and max_sessions >= 1, min_match_rate in [0, 1] (got "
                             f"{imbalance_bound}, {adapter_imbalance_bound}, {max_blocks}, "
                             f"{max_sessions}, {min_match_rate})")
        self.min_match_rate = min_match_rate
        self.imbalance_bound = imbalance_bound
        self.adapter_imbalance_bound = adapter_imbalance_bound
        self.max_blocks, self.max_sessions = max_blocks, max_sessions
        self._blocks: OrderedDict[bytes, set[Hashable]] = OrderedDict()
        self._sessions: OrderedDict[str, Hashable] = OrderedDict()
        self.held: Counter[Hashable] = Counter()  # block keys each replica holds
        self.conversations: Counter[Hashable] = Counter()  # sessions last served by each
        # (adapter, replica) -> when this router last sent the adapter there
        self._adapter_routes: OrderedDict[tuple[str, Hashable], float] = OrderedDict()
        # replica -> adapters of the requests this router sent there that are in flight
        self.running: dict[Hashable, Counter[str]] = {}
        # replica -> when this router last sent it a request (the clock of record's ``at``)
        self.routed_at: dict[Hashable, float] = {}

    def choose(self, keys: list[bytes], session: str | None, loads: Mapping[Hashable, int],
               adapter: str | None = None, adapter_holders: Collection[Hashable] = (),
               max_loras: Mapping[Hashable, int] | None = None,
               max_num_seqs: Mapping[Hashable, int] | None = None,
               newcomer: bool = False, unknown: Collection[Hashable] = ()) -> Choice:
        """Rank ``loads``' replicas for a request with prefix ``keys``, ``session`` and LoRA
        ``adapter`` (``name`` or ``name@vN``; None for the base model), which the replicas in
        ``adapter_holders`` hold (:meth:`adapter_holders`). ``max_loras``: each replica's
        adapters per batch, as reported (a replica missing from it: no LoRA slot rule);
        ``max_num_seqs``: each replica's requests at once, as reported (the adapter bound
        when none is configured: :meth:`adapter_bound`; the engine seats of rule 6);
        ``newcomer``: admission started the request in a newcomer slot (rule 6);
        ``unknown``: replicas whose load ``loads`` does not know (0 there; no seat counts as
        free on them).

        Raises:
            ValueError: ``loads`` is empty.
        """
        if not loads:
            raise ValueError("no replica to choose from")
        least = min(loads.values())
        by_load = sorted(loads, key=lambda r: (loads[r], str(r)))
        preferred, decision = self._preferred(keys, session, loads, adapter_holders)
        near = [r for r in by_load
                if loads[r] - least <= self.adapter_bound(r, max_num_seqs)]
        free = [r for r in near if self.lora_slot(r, adapter, max_loras)] if adapter else near
        if preferred:
            within = [r for r in preferred if loads[r] - least <= (
                self.adapter_bound(r, max_num_seqs) if decision == "adapter"
                else self.imbalance_bound)]
            if decision == "adapter" and within:
                fits = [r for r in within if r in free]
                if fits:
                    return Choice([fits, [r for r in by_load if r not in fits]], decision)
                if free:  # every holder's batches are full of other adapters: load it anew
                    return self._pack(adapter, free, loads, by_load, "spill")
            if within:
                return Choice([within, [r for r in by_load if r not in within]], decision)
            spill = [r for r in by_load if loads[r] == least]
            return Choice([spill, [r for r in by_load if r not in spill]], "spill")
        if adapter:  # a cold adapter
            return self._pack(adapter, free or near, loads, by_load, "new")
        if newcomer:
            seats = max_num_seqs or {}
            seated = [r for r in by_load if loads[r] < seats.get(r, 0) and r not in unknown]
            if seated:
                first = min(seated, key=lambda r: self.routed_at.get(r, -math.inf))
                return Choice([[first], [r for r in by_load if r != first]], "newcomer")
        coolest = [r for r in by_load if loads[r] == least]
        seed = keys[0] if keys else (session or "").encode("utf-8", "surrogatepass")
        coolest.sort(key=lambda r: (self.held[r] + self.conversations[r], _rendezvous(seed, r)))
        return Choice([coolest[:1], [r for r in by_load if r != coolest[0]]], "new")

    @staticmethod
    def _pack(adapter: str, among: list[Hashable], loads: Mapping[Hashable, int],
              by_load: list[Hashable], decision: Decision) -> Choice:
        """Where ``adapter`` is loaded anew: the least-loaded replica of ``among`` (sorted by
        load), ties broken by rendezvous hashing of its name, first. The least-loaded, for
        the adapter's requests run in the shortest steps there, and a LoRA batch slot is
        held for as short a time as it can be (docs/scale.md, "Many adapters"); by name
        among equals, so routers that see the same loads agree, and the adapter's next
        requests find it held (rule 3)."""
        coolest = [r for r in among if loads[r] == loads[among[0]]]
        name = adapter_name(adapter).encode("utf-8", "surrogatepass")
        top = min(coolest, key=lambda r: _rendezvous(name, r))
        return Choice([[top], [r for r in by_load if r != top]], decision)

    def adapter_bound(self, replica: Hashable,
                      max_num_seqs: Mapping[Hashable, int] | None) -> int:
        """Requests in flight ``replica`` may carry above the least-loaded replica and still
        take a request for an adapter it holds: ``adapter_imbalance_bound`` if configured,
        else its ``max_num_seqs`` as reported, else :data:`ADAPTER_IMBALANCE_BOUND`."""
        if self.adapter_imbalance_bound is not None:
            return self.adapter_imbalance_bound
        return (max_num_seqs or {}).get(replica) or ADAPTER_IMBALANCE_BOUND

    def lora_slot(self, replica: Hashable, adapter: str | None,
                  max_loras: Mapping[Hashable, int] | None) -> bool:
        """Whether a request for ``adapter`` can join ``replica``'s batches now: its
        requests in flight from this router use this adapter or fewer than its
        ``max_loras`` adapters (True when it reported none)."""
        limit = (max_loras or {}).get(replica)
        running = self.running.get(replica)
        return not limit or not running or adapter in running or len(running) < limit

    def _preferred(self, keys: list[bytes], session: str | None, loads: Mapping[Hashable, int],
                   adapter_holders: Collection[Hashable]) -> tuple[list[Hashable], Decision]:
        if session is not None and self._sessions.get(session) in loads:
            return [self._sessions[session]], "session"
        for i in range(len(keys) - 1, -1, -1):  # the longest held run of leading blocks
            if i + 1 < self.min_match_rate * len(keys):
                break  # too short a run to count (a shared system prompt, say)
            holders = [r for r in self._blocks.get(keys[i], ()) if r in loads]
            if holders:
                return holders, "hit"
        holders = [r for r in adapter_holders if r in loads]
        if holders:
            return holders, "adapter"
        return [], "new"

    def adapter_holders(self, adapter: str | None,
                        reported: Mapping[Hashable, tuple[Collection[str], float]]
                        ) -> list[Hashable]:
        """The replicas that hold ``adapter`` (``name`` matches any version; ``name@vN`` that
        version): those whose last report lists it, and those this router sent it to after
        their report. ``reported``: replica -> (resident ``name@vN`` keys, report time, s)."""
        if not adapter:
            return []
        versioned = "@" in adapter
        held = []
        for replica, (resident, at) in reported.items():
            names = resident if versioned else {adapter_name(k) for k in resident}
            if adapter in names or self._adapter_routes.get((adapter, replica), -1.0) > at:
                held.append(replica)
        return held

    def record(self, keys: list[bytes], session: str | None, replica: Hashable,
               adapter: str | None = None, at: float = 0.0) -> None:
        """``replica`` served the request: it now holds its blocks, its session and, from
        ``at`` (s, the clock of the replicas' reports), its ``adapter``, with a request on
        it in flight until :meth:`completed`; ``at`` is also when it was last sent one
        (:meth:`sent`)."""
        self.sent(replica, at)
        if adapter:
            self.running.setdefault(replica, Counter())[adapter] += 1
            self.placed(adapter, replica, at)
        for key in keys:
            holders = self._blocks.setdefault(key, set())
            if replica not in holders:
                holders.add(replica)
                self.held[replica] += 1
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            _, gone = self._blocks.popitem(last=False)
            for r in gone:
                self.held[r] -= 1
        if session is not None:
            before = self._sessions.get(session)
            if before != replica:
                if before is not None:
                    self.conversations[before] -= 1
                self.conversations[replica] += 1
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self.conversations[self._sessions.popitem(last=False)[1]] -= 1

    def placed(self, adapter: str, replica: Hashable, at: float) -> None:
        """``adapter`` goes to ``replica`` from ``at`` (s, the clock of the replicas'
        reports): it counts as held there (:meth:`adapter_holders`) until a report newer than
        ``at`` leaves it out. A router that loads a cold adapter anew ("new", "spill") calls it
        as it chooses: Serve routes a request only once the replica has accepted it, and the
        requests of a burst chosen meanwhile, which see that replica's queue one longer and
        may find another one less loaded, follow the adapter there instead."""
        self._adapter_routes[(adapter, replica)] = at
        self._adapter_routes.move_to_end((adapter, replica))
        while len(self._adapter_routes) > MAX_ADAPTER_ROUTES:
            self._adapter_routes.popitem(last=False)

    def sent(self, replica: Hashable, at: float) -> None:
        """This router sent ``replica`` a request at ``at`` (s, the clock of :meth:`record`):
        rule 6 prefers the replica sent to least recently. A router calls it as it chooses a
        replica for a newcomer: Serve routes a request only once the replica has accepted it,
        and the newcomers of a burst chosen meanwhile go to other replicas."""
        self.routed_at[replica] = at

    def completed(self, replica: Hashable, adapter: str) -> None:
        """A request on ``adapter`` that :meth:`record` sent to ``replica`` completed."""
        running = self.running.get(replica)
        if running and running[adapter] > 0:
            running[adapter] -= 1
            if not running[adapter]:
                del running[adapter]

    def forget(self, replica: Hashable) -> None:
        """``replica`` left: drop its blocks and sessions (and nothing else)."""
        for key in [k for k, holders in self._blocks.items() if replica in holders]:
            holders = self._blocks[key]
            holders.discard(replica)
            if not holders:
                del self._blocks[key]
        for s in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[s]
        for pair in [p for p in self._adapter_routes if p[1] == replica]:
            del self._adapter_routes[pair]
        self.held.pop(replica, None)
        self.routed_at.pop(replica, None)
        self.conversations.pop(replica, None)
        self.running.pop(replica, None)
