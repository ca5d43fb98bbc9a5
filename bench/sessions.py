"""Cache-aware replica routing against Serve's default router, in one run (``bench.py --sessions``).

Starts its own Ray cluster (free ports, 127.0.0.1) and deploys serve_configs/affinity.yaml
(smollm-v1 with two replicas) twice with the real ``serve deploy``: with the mesh's
AffinityRouter, then without ``request_router_config`` (Serve's power-of-two-choices), with a
``serve shutdown`` between so the router's handle is made anew. Each set-up gets the same
multi-turn load: ``--sessions`` conversations of ``--turns`` turns, each turn resending
the history, at most ``--in-flight`` requests at a time; a session that finishes a turn queues
behind the others (FIFO), so every session stays in the working set while the engines are not
swamped (a turn's TTFT is then its prefill, not its wait behind other sessions' decoding). Conversations belong to ``--tenants`` tenants; each starts with its
tenant's system prompt and a document of its own, ``--prefix-tokens`` tokens in all (counted
with the model's tokenizer), so the
sessions' KV (~45 KB per token here in float32) outgrows one replica's
``VLLM_CPU_KVCACHE_SPACE`` but fits in two. Then, affinity only, one hot prefix: every request
with the same system prompt, no sessions, to see it spread.

Prints TTFT p50/p95 of the turns after the first (the ones a cache can serve), tokens/s, the
prefix-cache hit rate from vLLM's own counters (``vllm:prefix_cache_hits`` / ``_queries``),
and each replica's share of the requests (``x-mesh-replica``); the headline on its own line,
``TTFT p50 affinity/default 0.42x``; then the replica each session's turns went to (what
``bench.py --sim --trust`` replays), and with ``--json FILE`` every figure as JSON, with
each request's trace (when it was sent, gave its first token and ended, and where).

    python scripts/bench.py --sessions 24 --turns 4 --prefix-tokens 1500 --in-flight 4
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

from bench.host_cpu import EngineShare
from bench.servers import start_local_ray
from bench.tokenizer import hf_tokenizer
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml, mesh_parts
from serve_app.common.wire import REPLICA_HEADER
from serve_app.observability.stats import percentile
from serve_app.release.deploy import deploy, replica_ids

CONFIG = REPO_ROOT / "serve_configs" / "affinity.yaml"

WORDS = ("order invoice parcel refund account ticket router engine replica cache tenant "
         "adapter token stream window budget canary rollout mirror shadow").split()


def document(seed: str, tokens: int, tokenizer) -> str:
    """Words drawn by ``seed``, about ``tokens`` tokens of the model's ``tokenizer``."""
    if tokens <= 0:
        return ""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens)]  # each word is a token or more
    n = len(tokenizer.encode(" ".join(words), add_special_tokens=False))
    return " ".join(words[:round(len(words) * tokens / n)])


async def chat(http: httpx.AsyncClient, messages: list[dict], max_tokens: int,
               session: str | None) -> dict:
    """One streamed chat: TTFT (s), completion tokens, the replica, ok, and when it was sent
    and ended (``time.monotonic()``, s)."""
    t0 = time.monotonic()
    out = {"ttft_s": None, "tokens": 0, "replica": None, "ok": False, "sent_at": t0}
    body = {"model": "smollm", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body,
                           headers={"x-session-id": session} if session else {}) as r:
        out["replica"] = r.headers.get(REPLICA_HEADER)
        async for line in r.aiter_lines():
            if line.startswith("data: {") and out["ttft_s"] is None and '"content"' in line:
                out["ttft_s"] = time.monotonic() - t0
            if '"usage":{' in line:
                out["tokens"] = json.loads(line[len("data: "):])["usage"]["completion_tokens"]
        out["ok"] = r.status_code == 200 and out["tokens"] == max_tokens
    out["done_at"] = time.monotonic()
    return out


def opening(s: int, tenants: int, prefix_tokens: int, tokenizer) -> list[dict]:
    """Session ``s``'s first turn: its tenant's system prompt (~200 tokens) and a document
    of its own, ``prefix_tokens`` in all."""
    tenant = s % tenants
    return [{"role": "system", "content": f"You are the assistant of tenant {tenant}. "
             + document(f"tenant-{tenant}", 190, tokenizer)},
            {"role": "user", "content": "Read this: " + document(
                f"session-{s}", prefix_tokens - 200, tokenizer) + " What is it about?"}]


def after_turn(t: int) -> list[dict]:
    """What the history gains after turn ``t``: a fixed answer (not the generated one, so
    the next prompt's length does not depend on the engine) and the next question."""
    return [{"role": "assistant", "content": "It is about orders."},
            {"role": "user", "content": f"And point {t + 1}?"}]


def prompt_token_ids(tokenizer, *, sessions: int, turns: int, prefix_tokens: int,
                     tenants: int) -> list[list[tuple[int, ...]]]:
    """Each session's prompt at each turn (``[session][turn]``), token ids as vLLM renders
    the chat (the model's chat template, generation prompt, no special tokens added): the
    load this benchmark sends, for the simulation to replay (``bench.py --sim --trust``)."""
    def ids(messages: list[dict]) -> tuple[int, ...]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        return tuple(tokenizer(text, add_special_tokens=False).input_ids)

    out = []
    for s in range(sessions):
        history, prompts = opening(s, tenants, prefix_tokens, tokenizer), []
        for t in range(turns):
            prompts.append(ids(history))
            history += after_turn(t)
        out.append(prompts)
    return out


async def sessions_load(url: str, a, tokenizer) -> tuple[list[dict], float]:
    async def conversation(http, s: int) -> list[dict]:
        history = opening(s, a.tenants, a.prefix_tokens, tokenizer)
        results = []
        for t in range(a.turns):
            async with turn_slots:  # FIFO: a finished turn queues behind the other sessions
                r = await chat(http, history, a.max_tokens, f"bench-{s}")
            results.append({**r, "session": s, "turn": t})
            history += after_turn(t)
        return results

    turn_slots = asyncio.Semaphore(a.in_flight or a.sessions)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.monotonic()
        done = await asyncio.gather(*(conversation(http, s) for s in range(a.sessions)))
        return [r for c in done for r in c], time.monotonic() - t0


async def hot_load(url: str, a, tokenizer) -> list[dict]:
    system = ("You are the one assistant everybody uses. "
              + document("hot", a.prefix_tokens, tokenizer))

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(i: int) -> dict:
            return await chat(http, [{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {i}?"}],
                              a.max_tokens, None)
        sem = asyncio.Semaphore(8)

        async def bounded(i: int) -> dict:
            async with sem:
                return await one(i)
        return await asyncio.gather(*(bounded(i) for i in range(4 * a.sessions)))


def prefix_counters(metrics_url: str) -> tuple[float, float]:
    """vLLM's prefix-cache (hits, queries), summed over every engine, in tokens."""
    hits = queries = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("ray_vllm_prefix_cache_hits_total{"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("ray_vllm_prefix_cache_queries_total{"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def figures(results: list[dict], wall_s: float, hit_rate: float, replicas: set[str]) -> dict:
    later = [r["ttft_s"] * 1000 for r in results if r["ok"] and r["turn"] > 0 and r["ttft_s"]]
    requests = trace(results, replicas)
    return {"ttft_p50_ms": percentile(later, 50), "ttft_p95_ms": percentile(later, 95),
            "tokens_per_s": sum(r["tokens"] for r in results if r["ok"]) / wall_s,
            "hit_rate": hit_rate, "errors": sum(not r["ok"] for r in results),
            "share": per_replica(results, replicas), "placement": placement(requests),
            "trace": requests}


async def warm_up(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await chat(http, [{"role": "user", "content": "warm up"}], 2, None)


def per_replica(results: list[dict], replicas: set[str]) -> list[int]:
    """Requests each replica served, busiest first (0 for one that served none)."""
    served = Counter(r["replica"] for r in results)
    return sorted((served[r] for r in replicas), reverse=True)


def trace(results: list[dict], replicas: set[str]) -> list[dict]:
    """Every request in the order it was sent: session, turn, replica (its index among
    ``replicas`` sorted; None: none answered), and when it was sent, gave its first
    token and ended, s from the first send (``--json`` writes it: the order in which each
    replica's slots came free, which sets where Serve's default router sends the next turn)."""
    index = {r: i for i, r in enumerate(sorted(replicas))}
    start = min(r["sent_at"] for r in results)
    return [{"session": r["session"], "turn": r["turn"], "replica": index.get(r["replica"]),
             "sent_s": round(r["sent_at"] - start, 3),
             "first_token_s": None if r["ttft_s"] is None else
             round(r["sent_at"] + r["ttft_s"] - start, 3),
             "done_s": round(r["done_at"] - start, 3)}
            for r in sorted(results, key=lambda r: r["sent_at"])]


def placement(requests: list[dict]) -> str:
    """The replica each turn of a :func:`trace` went to, a digit a turn (``?``: none
    answered), a group of digits a session, sessions in order: what ``bench.py --sim
    --trust`` replays to put a real run's placement on the simulated fleet."""
    turns: dict[int, list[str]] = {}
    for r in sorted(requests, key=lambda r: (r["session"], r["turn"])):
        turns.setdefault(r["session"], []).append("?" if r["replica"] is None
                                                   else str(r["replica"]))
    return " ".join("".join(t) for _, t in sorted(turns.items()))


def tokenizer_of(config: dict):
    """The tokenizer of ``config``'s variant (what its engines count tokens with)."""
    return hf_tokenizer(mesh_parts(config).variant()["args"]["model"])


def run(a) -> None:
    """The whole benchmark (see the module docstring); ``a``: bench.py's arguments."""
    import ray
    from ray import serve

    base = load_yaml(CONFIG)
    tokenizer = tokenizer_of(base)
    dashboard, http_port, metrics = start_local_ray()
    url = f"http://127.0.0.1:{http_port}"
    base["http_options"] = {"host": "127.0.0.1", "port": http_port}
    rows = {}
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for setup in ("affinity", "default"):
            cfg = copy.deepcopy(base)
            if setup == "default":
                cfg["applications"][1]["deployments"][0].pop("request_router_config")
            path = workdir / f"bench-{setup}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            print(f"[bench] {setup}: serve deploy (two engines start)", flush=True)
            deploy(path, dashboard, log=lambda m: None)
            replicas = replica_ids(dashboard, "smollm-v1", "LLMReplica")
            asyncio.run(warm_up(url))
            time.sleep(6)  # the metrics export catches up
            h0, q0 = prefix_counters(metrics)
            with EngineShare() as share:
                results, wall = asyncio.run(sessions_load(url, a, tokenizer))
            time.sleep(6)
            h1, q1 = prefix_counters(metrics)
            rows[setup] = figures(results, wall, (h1 - h0) / max(1.0, q1 - q0), replicas)
            rows[setup].update(share.figures())
            shown = {k: v for k, v in rows[setup].items() if k != "trace"}  # --json has it
            print(f"[bench] {setup}: {shown}", flush=True)
            if setup == "affinity":
                hot = asyncio.run(hot_load(url, a, tokenizer))
                rows["hot"] = per_replica(hot, replicas)
                print(f"[bench] one hot prefix, {len(hot)} requests: per replica {rows['hot']}",
                      flush=True)
            serve.shutdown()
    finally:
        ray.shutdown()
    aff, dflt = rows["affinity"], rows["default"]
    print(f"\n{a.sessions} sessions x {a.turns} turns, {a.tenants} tenants, ~{a.prefix_tokens} "
          f"prefix tokens each, {a.max_tokens} tokens per answer, "
          f"{a.in_flight or a.sessions} in flight, 2 replicas")
    print("| router | TTFT p50 ms | TTFT p95 ms | tokens/s | prefix-cache hit rate | "
          "requests per replica | errors | busy engines x worker cores each |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in (("affinity (mesh)", aff), ("Serve default", dflt)):
        print(f"| {name} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | "
              f"{r['tokens_per_s']:.1f} | {r['hit_rate']:.2f} | {r['share']} | {r['errors']} | "
              f"{r['engines']} |")
    print(f"\nTTFT p50 affinity/default {aff['ttft_p50_ms'] / dflt['ttft_p50_ms']:.2f}x")
    print(f"tokens/s affinity/default {aff['tokens_per_s'] / dflt['tokens_per_s']:.2f}x")
    print(f"prefix-cache hit rate affinity {aff['hit_rate']:.2f}, default {dflt['hit_rate']:.2f}")
    hot = rows["hot"]
    print(f"one hot prefix busiest/least busy replica {hot[0] / max(1, hot[-1]):.2f}x {hot}")
    for name in ("affinity", "default"):
        print(f"{name}: the replica of each session's turns: {rows[name]['placement']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                                            "args": vars(a), "rows": rows}, indent=2,
                                           default=str))
        print(f"[bench] figures written to {a.json}")

