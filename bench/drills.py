"""The overload drill: a flood of low-priority requests against a high-priority tenant's
latency, measured in one run (``scripts/drill_overload.py``,
``tests/integration/test_overload.py``).

1. **idle**: the probe tenant sends ``probes`` streamed chats one after another on the idle
   mesh: its TTFT p95 is the baseline.
2. **flood**: ``requests`` low-priority chats are sent all at once (no client retries, a
   ``timeout_s`` client timeout) while the probe keeps sending, one after another.

It reports what the flood got (answers, refusals by status, client timeouts, whether every
refusal carried ``Retry-After``, how fast refusals came), its goodput (the flood's answers
per second while it was answered, and the answers against that rate x ``queue_timeout_s``:
what the engines could have finished within the queue's deadline), and the probe's TTFT
against idle:
while the flood runs (probes started after 95 % of the flood's refusals were out, so the
mesh is full of admitted low-priority work), and during the burst itself (before that, while
the mesh is still turning the arrivals away).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from serve_app.observability.stats import percentile
from bench.loadgen import Answer, LoadSpec, RequestResult, flood, probe


#: Refusal codes decided at arrival (the rest, ``shed`` and ``queue_timeout``, come later:
#: when a better-ordered arrival pushes a queued request past its deadline, or at it).
ARRIVAL_CODES = ("overloaded", "concurrency_limit_exceeded", "rate_limit_exceeded",
                 "tokens_exhausted")


def _ttft_ms(results: list[RequestResult]) -> list[float]:
    return [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None]


async def overload_drill(base_url: str, *, flood_key: str, probe_key: str, requests: int = 400,
                         max_tokens: int = 16, timeout_s: float = 60, probes: int = 20,
                         probe_max_tokens: int = 4, model: str = "smollm",
                         queue_timeout_s: float = 30.0, log=print,
                         request_id_prefix: str | None = None) -> dict[str, Any]:
    """Run the drill against ``base_url`` (``http://host:port/v1``); returns its figures.

    Returns:
        ``idle_ttft_p50_ms``, ``idle_ttft_p95_ms``, ``flood_ttft_p50_ms``,
        ``flood_ttft_p95_ms``, ``ttft_p95_ratio`` (flood / idle), ``burst_ttft_max_ms``
        (the worst probe TTFT while the burst was being turned away), ``probe_requests``
        (while the flood ran), ``probe_errors`` (all probes); for the flood: ``sent``, ``answered`` (200), ``refused``
        (status -> count), ``timeouts`` (client timeouts), ``other_errors``,
        ``refusals_with_retry_after``, ``refusal_p95_ms`` (arrival to refusal),
        ``refused_by_code`` (error code -> count), ``arrival_refusal_p95_ms`` (the same
        p95 over the refusals decided at arrival, :data:`ARRIVAL_CODES`; 0.0: none),
        ``flood_wall_s``, ``sustained_per_s`` (answers / the time of the last answer, s:
        the flood is sent at once), ``goodput_ratio`` (answers / (``sustained_per_s`` x
        ``queue_timeout_s``), the route's admission deadline).
        ``request_id_prefix``: the flood's ``x-request-id`` prefix (:func:`flood`).
    """
    spec = LoadSpec(base_url=base_url, model=model, api_key=probe_key, requests=probes,
                    max_tokens=probe_max_tokens, prompt="What is the capital of France?",
                    timeout_s=timeout_s)
    log(f"[drill] idle: {probes} probe requests, one after another")
    idle = await probe(spec, asyncio.Event(), pause_s=0.1)
    log(f"[drill] flood: {requests} requests at once (max_tokens {max_tokens}, client timeout "
        f"{timeout_s:g} s) while the probe keeps sending")
    stop = asyncio.Event()
    t0 = time.monotonic()
    flood_task = asyncio.create_task(flood(base_url, flood_key, requests=requests,
                                           max_tokens=max_tokens, timeout_s=timeout_s,
                                           model=model, request_id_prefix=request_id_prefix))
    probe_task = asyncio.create_task(probe(
        LoadSpec(**{**spec.__dict__, "requests": 10**6}), stop))
    answers: list[Answer] = await flood_task
    wall = time.monotonic() - t0
    stop.set()
    probes_during = await probe_task
    refused = [a for a in answers if a.status not in (0, 200)]
    settled_s = percentile([a.latency_s for a in refused], 95) if refused else 0.0
    during = [r for r in probes_during if r.started_at - t0 >= settled_s]
    burst = [r for r in probes_during if r.started_at - t0 < settled_s]
    idle_ttft, flood_ttft = _ttft_ms(idle), _ttft_ms(during)
    figures = {
        "idle_ttft_p50_ms": percentile(idle_ttft, 50),
        "idle_ttft_p95_ms": percentile(idle_ttft, 95),
        "flood_ttft_p50_ms": percentile(flood_ttft, 50),
        "flood_ttft_p95_ms": percentile(flood_ttft, 95),
        "burst_ttft_max_ms": max(_ttft_ms(burst), default=float("nan")),
        "probe_requests": len(during),
        "probe_errors": sum(not r.ok for r in probes_during) + sum(not r.ok for r in idle),
        "sent": len(answers),
        "answered": sum(a.status == 200 for a in answers),
        "refused": dict(sorted(Counter(a.status for a in refused).items())),
        "timeouts": sum(a.timed_out for a in answers),
        "other_errors": sum(a.status == 0 and not a.timed_out for a in answers),
        "refusals_with_retry_after": sum(a.retry_after is not None for a in refused),
        "refusal_p95_ms": percentile([a.latency_s * 1000 for a in refused], 95),
        "refused_by_code": dict(sorted(Counter(a.code or str(a.status)
                                               for a in refused).items())),
        "arrival_refusal_p95_ms": percentile([a.latency_s * 1000 for a in refused
                                              if a.code in ARRIVAL_CODES], 95)
        if any(a.code in ARRIVAL_CODES for a in refused) else 0.0,
        "flood_wall_s": wall,
    }
    figures["ttft_p95_ratio"] = figures["flood_ttft_p95_ms"] / figures["idle_ttft_p95_ms"]
    done = [a.latency_s for a in answers if a.status == 200]
    figures["sustained_per_s"] = len(done) / max(done) if done else 0.0
    figures["goodput_ratio"] = (len(done) / (figures["sustained_per_s"] * queue_timeout_s)
                                if done else 0.0)
    return figures


def format_figures(label: str, f: dict[str, Any]) -> list[str]:
    """The drill's figures as a few readable lines."""
    refused = ", ".join(f"{n}x{s}" for s, n in f["refused"].items()) or "none"
    codes = ", ".join(f"{n} {c}" for c, n in f["refused_by_code"].items()) or "none"
    return [
        f"{label}: flood of {f['sent']}: {f['answered']} answered, refused {refused} "
        f"({f['refusals_with_retry_after']} with Retry-After, p95 {f['refusal_p95_ms']:.0f} ms "
        f"after arrival), {f['timeouts']} client timeouts, {f['other_errors']} other errors, "
        f"{f['flood_wall_s']:.1f} s",
        f"{label}: refusals by code: {codes}; those decided at arrival p95 "
        f"{f['arrival_refusal_p95_ms']:.0f} ms",
        f"{label}: goodput: the engines finished {f['sustained_per_s']:.2f} flood requests/s; "
        f"{f['answered']} answers are {f['goodput_ratio']:.2f} x (that rate x queue_timeout_s)",
        f"{label}: high-priority TTFT p50/p95 idle {f['idle_ttft_p50_ms']:.0f}/"
        f"{f['idle_ttft_p95_ms']:.0f} ms, during the flood {f['flood_ttft_p50_ms']:.0f}/"
        f"{f['flood_ttft_p95_ms']:.0f} ms over {f['probe_requests']} requests "
        f"(p95 x{f['ttft_p95_ratio']:.2f}); worst while the burst was turned away "
        f"{f['burst_ttft_max_ms']:.0f} ms; {f['probe_errors']} probe errors",
    ]


def without_priorities(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a Serve config with every tenant at the default priority: the drill's
    "priority off" run (FIFO admission, no reserved slots in use, FCFS order in vLLM)."""
    import copy

    from serve_app.common.serve_configs import mesh_parts

    out = copy.deepcopy(config)
    for tenant in (mesh_parts(out).router_user_config or {}).get("tenants", []):
        tenant.pop("priority", None)
    return out


def herd_table(answers: list[Answer]) -> list[tuple[str, int, str]]:
    """What a herd's clients got (:func:`~bench.loadgen.flood` with streams), as
    ``(what, count, when)`` rows: each outcome (status, error code, stream or not, complete
    or cut) with the p50 and max of when its status arrived, s."""
    groups: dict[str, list[Answer]] = {}
    for a in answers:
        kind = "stream" if a.stream else "whole"
        if a.status == 200:
            what = f"200 {kind}, complete" if a.complete else f"200 {kind}, in-band {a.code}"
        elif a.status:
            what = f"{a.status} {a.code or ''} {kind}" + (
                ", Retry-After" if a.retry_after else ", no Retry-After")
        else:
            what = f"client {'timeout' if a.timed_out else 'error'} ({kind})"
        groups.setdefault(what, []).append(a)
    return [(what, len(group), f"status p50 {percentile([a.status_s for a in group], 50):.2f}"
             f" s, max {max(a.status_s for a in group):.2f} s")
            for what, group in sorted(groups.items())]
