"""Fit a simulated engine's profile from a real engine, and check the fit.

The same workload rows run on an engine through vLLM's OpenAI layer
(:meth:`~serve_app.server.engine_protocol.Engine.run`, streaming, times taken as the client sees
them), first on real vLLM, then on the simulated engine with the fitted profile:

* ``decode c=N`` (N = 1, 8, 32): requests of :data:`DECODE_TOKENS` tokens (``ignore_eos``)
  at concurrency N: tokens/s, TTFT p50, time per output token (TPOT) p50 and the spread of
  the gaps between a stream's tokens (their coefficient of variation);
* ``prefill``: prompts of about :data:`PREFILL_WORDS` tokens, one token each: TTFT p50;
* ``adapters k`` (k = 1, 2, 4, 8): concurrency 8, request i on adapter i mod k: tokens/s;
* ``adapter load``: seconds to load each of 8 adapters.

:func:`fit` turns the real rows into a :class:`~serve_app.common.sim_profile.SimProfile`:
the decode table from TPOT at each concurrency, the prefill rate from the prefill row's TTFT
less one decode step, the per-adapter step cost from the slope of TPOT over k, the load time
and start time as measured, the KV blocks the real engine allocated, and a step's spread
from the gaps between tokens in the decode rows at concurrency 1 and 8 (a row's requests
start and end together, so no other request's prefill lands between two of its tokens; 1 to
8 in flight is what ``bench.py --sim --trust`` replays).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

#: Tokens generated per request of a decode row.
DECODE_TOKENS = 64
#: Words in a prefill row's prompt (about as many tokens).
PREFILL_WORDS = 1000
#: Concurrencies of the decode rows.
CONCURRENCIES = (1, 8, 32)
#: Distinct adapters in the adapter rows.
ADAPTER_COUNTS = (1, 2, 4, 8)
#: Largest error a fitted profile may show on a row (tokens/s and TTFT p50), as a share.
FIT_TOLERANCE = 0.20


@dataclass
class Row:
    """One workload row's figures (s, tokens/s); ``None`` where the row has no such figure."""

    name: str
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_cv: float | None = None  # the gaps between a stream's tokens: sd / mean


async def _stream(engine, body: dict[str, Any]) -> tuple[float, float, int, list[float]]:
    """TTFT (s), the time of the last token (s), the tokens of one streamed request and the
    gaps between its tokens (s) from the second on (the first gap holds the first decode
    after the prefill step); no gaps when a chunk held more than one token (the client fell
    behind and vLLM merged them), which would count two steps as one gap."""
    t0 = time.monotonic()
    first = last = None
    tokens = 0
    gaps: list[float] = []
    answer = await engine.run("completion", {**body, "stream": True,
                                             "stream_options": {"include_usage": True}})
    async for line in answer:
        for event in line.split("\n\n"):
            data = event.strip().removeprefix("data: ")
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            if any(c.get("text") for c in chunk.get("choices") or ()):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError(f"no token in the answer to {body}")
    return first - t0, last - t0, tokens, gaps[1:] if len(gaps) == tokens - 1 else []


def _prompt(i: int, words: int = 12) -> str:
    """A prompt unique to ``i`` (no prefix shared with another), of about ``words`` tokens."""
    vocab = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
             "november oscar papa quebec romeo sierra tango uniform victor whiskey").split()
    return f"Request {i}: " + " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words))


async def run_row(engine, name: str, n: int, concurrency: int, *, max_tokens: int,
                  words: int = 12, adapters: list[str] | None = None, route: str) -> Row:
    """``n`` streamed completions at ``concurrency``; request i on ``adapters[i % k]``."""
    sem = asyncio.Semaphore(concurrency)
    results: list[tuple[float, float, int, list[float]]] = []

    async def one(i: int) -> None:
        model = f"{adapters[i % len(adapters)]}" if adapters else route
        async with sem:
            results.append(await _stream(engine, {
                "model": model, "prompt": _prompt(i + 1000 * len(name), words),
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}))

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.monotonic() - t0
    tokens = sum(r[2] for r in results)
    tpots = [(last - first) / (k - 1) for first, last, k, _ in results if k > 1]
    gaps = [g for r in results for g in r[3]]
    return Row(name, tokens_per_s=tokens / elapsed,
               ttft_p50_s=statistics.median(r[0] for r in results),
               tpot_p50_s=statistics.median(tpots) if tpots else None,
               tpot_cv=statistics.pstdev(gaps) / statistics.fmean(gaps) if len(gaps) > 1
               else None)


async def measure(engine, route: str, adapter_names: list[str], *, quick: bool = False
                  ) -> list[Row]:
    """Every row on ``engine`` (an :class:`~serve_app.server.engine_protocol.Engine`,
    started); ``adapter_names``: 8 adapters the
    engine has loaded (their ``lora_name``). ``quick`` halves the requests."""
    scale = 1 if quick else 2
    rows = []
    await run_row(engine, "warm-up", 2, 2, max_tokens=4, route=route)
    for c in CONCURRENCIES:
        rows.append(await run_row(engine, f"decode c={c}", max(4, c) * scale, c,
                                  max_tokens=DECODE_TOKENS, route=route))
    rows.append(await run_row(engine, "prefill", 3 * scale, 1, max_tokens=1,
                              words=PREFILL_WORDS, route=route))
    for k in ADAPTER_COUNTS:
        rows.append(await run_row(engine, f"adapters k={k}", 8 * scale, 8, max_tokens=32,
                                  adapters=adapter_names[:k], route=route))
    return rows


def fit(rows: list[Row], *, name: str, description: str, source: str, load_s: float,
        start_s: float, kv_blocks: int, block_size: int, prompt_tokens: int,
        short_prompt_tokens: int) -> dict[str, Any]:
    """A profile (as a dict for :class:`~serve_app.common.sim_profile.SimProfile`) from real rows.

    The decode table is each decode row's TPOT. A decode row's requests start in waves of
    its concurrency c (they all generate the same tokens), so its TTFT is one step that
    prefills c short prompts: the short-prompt prefill rate comes from the c=8 and c=32
    rows. The prefill row's one long prompt takes longer than that rate says: the excess,
    over n², is the quadratic part. The adapter rows' TTFT over the base rate gives the
    extra prefill cost per token on an adapter, and their TPOT by k (distinct adapters)
    the per-adapter step cost (slope) and the cost of any adapter (intercept).

    Args:
        load_s: median adapter load time, s. start_s: engine start time, s.
        kv_blocks, block_size: the real engine's KV cache.
        prompt_tokens: tokens in a prefill row's prompt; short_prompt_tokens: in the
            other rows' prompts.
    """
    by = {r.name: r for r in rows}
    decode = {c: round(by[f"decode c={c}"].tpot_p50_s, 5) for c in CONCURRENCIES}
    wave = [(c, by[f"decode c={c}"].ttft_p50_s - decode[c]) for c in CONCURRENCIES if c > 1]
    rate = statistics.fmean(c * short_prompt_tokens / max(s, 1e-3) for c, s in wave)
    quadratic = _quadratic(by["prefill"].ttft_p50_s, decode[1], prompt_tokens, rate)
    # TPOT at concurrency 8 by distinct adapters: the slope is each adapter's step cost
    ks = list(ADAPTER_COUNTS)
    tpots = [by[f"adapters k={k}"].tpot_p50_s for k in ks]
    mean_k, mean_t = statistics.fmean(ks), statistics.fmean(tpots)
    slope = (sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, tpots))
             / sum((k - mean_k) ** 2 for k in ks))
    base_with_lora = mean_t - slope * mean_k  # TPOT at 8 running, 0 adapters, on a LoRA engine
    # An adapter row's TTFT: a wave of 8 adapter prompts prefilled in one step
    lora_prefill = statistics.fmean(
        (by[f"adapters k={k}"].ttft_p50_s - tpot) / (8 * short_prompt_tokens) - 1 / rate
        for k, tpot in zip(ks, tpots))
    return {"name": name, "description": description, "source": source,
            "prefill_tokens_per_s": round(rate, 1),
            "prefill_s_per_token_squared": float(f"{quadratic:.3g}"),
            "lora_prefill_s_per_token": round(max(lora_prefill, 0.0), 6),
            "decode_step_s": decode,
            "step_s_per_adapter": round(max(slope, 0.0), 5),
            "lora_step_s": round(max(base_with_lora - decode[8], 0.0), 5),
            "adapter_load_s": round(load_s, 4), "adapter_unload_s": 0.0,
            "engine_start_s": round(start_s, 1), "kv_blocks": kv_blocks,
            "block_size": block_size,
            "step_time_cv": round(statistics.fmean(
                [cv for c in (1, 8) if (cv := by[f"decode c={c}"].tpot_cv) is not None] or [0.0]),
                3)}


def _quadratic(long_ttft_s: float, one_step_s: float, prompt_tokens: int, rate: float
               ) -> float:
    """The quadratic prefill term (s per token²): what the prefill row's long prompt took
    (its TTFT less one decode step) beyond ``rate`` (tokens/s), over its tokens squared."""
    long_s = max(long_ttft_s - one_step_s, 1e-3)
    return max(long_s - prompt_tokens / rate, 0.0) / prompt_tokens ** 2


def refit(profile: dict[str, Any], *, prompt_tokens: int, short_prompt_tokens: int
          ) -> dict[str, Any]:
    """``profile`` (a dict with the ``fit`` of its last run) with its prefill terms moved
    so that the simulated TTFT rows come to the real ones.

    :func:`fit` reads the prefill rate off the decode rows' TTFT as if a wave of c requests
    were prefilled in one step; the sim, like vLLM, starts the wave's first arrival in a step
    of its own, so its TTFT comes out higher than the real one. One correction from the
    measured gap: the prefill rate by the ratio of (TTFT - TPOT) sim to real over the decode
    rows with c > 1, the quadratic part recomputed for the long prompt at that rate, and the
    LoRA prefill cost by the adapter rows' gap beyond the c=8 row's (the same wave of 8).
    Run the sim rows again after it (``scripts/calibrate_sim.py --refit``)."""
    rows = {r["row"]: r for r in profile["fit"]}
    decode = profile["decode_step_s"]

    def gap(name: str) -> tuple[float, float]:
        t = rows[name]["ttft_p50_s"]
        return t["sim"], t["real"]

    ratios = []
    for c in CONCURRENCIES[1:]:
        sim, real = gap(f"decode c={c}")
        ratios.append((sim - decode[c]) / max(real - decode[c], 1e-3))
    rate = profile["prefill_tokens_per_s"] * statistics.fmean(ratios)
    quadratic = _quadratic(gap("prefill")[1], decode[1], prompt_tokens, rate)
    sim_8, real_8 = gap("decode c=8")
    over_8 = sim_8 - real_8
    over_lora = statistics.fmean(s - r for s, r in (gap(f"adapters k={k}")
                                                   for k in ADAPTER_COUNTS))
    lora = profile.get("lora_prefill_s_per_token", 0.0) - (over_lora - over_8) / (
        8 * short_prompt_tokens)
    out = {k: v for k, v in profile.items() if k != "fit"}
    out.update(prefill_tokens_per_s=round(rate, 1),
               prefill_s_per_token_squared=float(f"{quadratic:.3g}"),
               lora_prefill_s_per_token=round(max(lora, 0.0), 6))
    return out


def rows_from_fit(fit: list[dict[str, Any]]) -> list[Row]:
    """The real rows a profile's ``fit`` recorded (tokens/s and TTFT p50)."""
    return [Row(r["row"], tokens_per_s=r.get("tokens_per_s", {}).get("real"),
                ttft_p50_s=r.get("ttft_p50_s", {}).get("real")) for r in fit]


def errors(real: list[Row], sim: list[Row]) -> list[dict[str, Any]]:
    """Per row: the real and simulated tokens/s and TTFT p50, and each one's error
    (sim / real - 1)."""
    out = []
    for r, s in zip(real, sim):
        row: dict[str, Any] = {"row": r.name}
        for metric in ("tokens_per_s", "ttft_p50_s"):
            a, b = getattr(r, metric), getattr(s, metric)
            if a:
                row[metric] = {"real": round(a, 4), "sim": round(b, 4),
                               "error": round(b / a - 1, 3)}
        out.append(row)
    return out
