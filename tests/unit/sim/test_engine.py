"""The simulated engine without Ray: its cost model, scheduler and answers exactly (the
scheduler is pure: each step's length comes from the profile, no clock is read), then the
whole engine in-process behind vLLM's own OpenAI layer (:func:`start_engine` with
``engine: sim``): answers keyed by adapter and prompt, exact usage, vLLM's errors and stream
format, max_num_seqs and priority, adapter loads, death."""

from __future__ import annotations

import asyncio
import json
import random
import statistics

import pytest

from serve_app.common.config import VariantArgs
from bench import calibration
from serve_app.sim.answers import AnswerBook
from serve_app.sim.prefix_cache import PrefixCache
from serve_app.common.sim_profile import SimProfile, load_profile, profile_names
from serve_app.sim.scheduler import LENGTH, STOP, SimRequest, SimScheduler
from tests.support.bodies import chat_body

PROFILE = SimProfile(name="t", description="test", source="this test",
                     prefill_tokens_per_s=1000, decode_step_s={1: 0.01, 9: 0.05},
                     lora_step_s=0.002, step_s_per_adapter=0.001, kv_blocks=100, block_size=4)


class Tokenizer:
    """A tokenizer of the sim's needs: words are ids 10.., EOS is 2."""

    eos_token_id = 2
    WORDS = ["alpha", "bravo", "charlie", "delta", "echo"]

    def get_vocab(self):
        return {f"Ġ{w}": 10 + i for i, w in enumerate(self.WORDS)} | {"<eos>": 2, "@": 3}

    def decode(self, ids):
        return "".join(" " + self.WORDS[i - 10] if i >= 10 else "@" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [3] * len(text.split("@"))


def test_profile_interpolates_the_decode_table_and_adds_prefill_and_adapters():
    assert PROFILE.decode_s(1) == 0.01 and PROFILE.decode_s(9) == 0.05
    assert PROFILE.decode_s(5) == pytest.approx(0.03)
    assert PROFILE.decode_s(17) == pytest.approx(0.09)  # past the table: the last slope
    assert PROFILE.decode_s(0) == 0.0
    assert PROFILE.step_s(batch=1, prefill_tokens=500, adapters=0) == pytest.approx(0.51)
    assert PROFILE.step_s(batch=1, prefill_tokens=0, adapters=3) == pytest.approx(0.015)


def test_attention_prices_new_tokens_by_the_context_before_them_cached_or_not():
    """The quadratic part is n x (n + 2c) (causal attention's n·c + n²/2 pairs, the term
    fitted as x n² at c = 0): 100 new tokens after 900 cached cost 100 x 1,900, more than
    the same 100 alone (100²) and less than all 1,000 uncached (1,000²)."""
    quad = PROFILE.model_copy(update={"prefill_s_per_token_squared": 1e-6})
    alone = quad.step_s(batch=1, prefill_tokens=100, adapters=0, prefill_lengths=[100])
    after = quad.step_s(batch=1, prefill_tokens=100, adapters=0, prefill_lengths=[100],
                        prefill_cached=[900])
    assert after - alone == pytest.approx(1e-6 * 100 * 1800)
    whole = quad.step_s(batch=1, prefill_tokens=1000, adapters=0, prefill_lengths=[1000])
    assert alone < after < whole
    two = quad.step_s(batch=2, prefill_tokens=150, adapters=0, prefill_lengths=[100, 50],
                      prefill_cached=[900, 0])
    assert two == pytest.approx(PROFILE.step_s(batch=2, prefill_tokens=150, adapters=0)
                                + 1e-6 * (100 * 1900 + 50 * 50))


def test_a_scaled_profile_takes_that_share_of_every_duration():
    quick = PROFILE.scaled(0.25)
    for kw in ({"batch": 1, "prefill_tokens": 500, "adapters": 0},
               {"batch": 9, "prefill_tokens": 40, "adapters": 3}):
        assert quick.step_s(**kw) == pytest.approx(0.25 * PROFILE.step_s(**kw))
    assert quick.adapter_load_s == pytest.approx(0.25 * PROFILE.adapter_load_s)
    assert quick.description.endswith("every duration x0.25")
    assert PROFILE.scaled(1) is PROFILE


def test_a_steps_factor_has_mean_1_and_the_profiles_cv():
    rng = random.Random(0)
    draws = [PROFILE.model_copy(update={"step_time_cv": 0.1}).step_factor(rng)
             for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.005)
    assert statistics.pstdev(draws) == pytest.approx(0.1, abs=0.005)
    state = rng.getstate()
    assert PROFILE.step_factor(rng) == 1.0 and rng.getstate() == state  # cv 0: no draw


def test_a_fit_takes_a_steps_spread_from_the_decode_rows_at_1_and_8():
    rows = [calibration.Row(f"decode c={c}", tokens_per_s=c / 0.1, ttft_p50_s=0.1 + 0.01 * c,
                            tpot_p50_s=0.1 + 0.001 * c, tpot_cv=cv)
            for c, cv in zip(calibration.CONCURRENCIES, (0.08, 0.1, 0.5))]
    rows += [calibration.Row("prefill", ttft_p50_s=3.0)]
    rows += [calibration.Row(f"adapters k={k}", ttft_p50_s=0.3, tpot_p50_s=0.11 + 0.01 * k)
             for k in calibration.ADAPTER_COUNTS]
    out = calibration.fit(rows, name="t", description="d", source="s", load_s=0.1,
                          start_s=1.0, kv_blocks=10, block_size=16, prompt_tokens=1000,
                          short_prompt_tokens=20)
    assert out["step_time_cv"] == pytest.approx(0.09)  # the rows at 1 and 8 in flight
    assert out["decode_step_s"] == {1: 0.101, 8: 0.108, 32: 0.132}
    assert out["step_s_per_adapter"] == pytest.approx(0.01)
    SimProfile.model_validate(out)


def test_a_refit_moves_the_prefill_terms_by_the_recorded_gaps():
    """Sim TTFT rows 30 % over the real ones (beyond one decode step): the prefill rate goes
    up by that ratio, the LoRA cost down by the adapter rows' extra gap per token."""
    def row(name, real, sim):
        return {"row": name, "ttft_p50_s": {"real": real, "sim": sim}}
    decode = {1: 0.1, 8: 0.2, 32: 0.3}
    fit = [row("decode c=1", 0.2, 0.2), row("decode c=8", 0.2 + 1.0, 0.2 + 1.3),
           row("decode c=32", 0.3 + 4.0, 0.3 + 5.2), row("prefill", 5.1, 5.1),
           *(row(f"adapters k={k}", 2.0, 2.3 + 0.4) for k in calibration.ADAPTER_COUNTS)]
    profile = {"prefill_tokens_per_s": 200.0, "lora_prefill_s_per_token": 0.01,
               "decode_step_s": decode, "fit": fit}
    out = calibration.refit(profile, prompt_tokens=1000, short_prompt_tokens=20)
    assert out["prefill_tokens_per_s"] == pytest.approx(260.0)
    assert out["prefill_s_per_token_squared"] == pytest.approx((5.0 - 1000 / 260) / 1e6,
                                                               rel=1e-2)
    assert out["lora_prefill_s_per_token"] == pytest.approx(0.01 - 0.4 / 160)
    assert "fit" not in out
    assert [r.ttft_p50_s for r in calibration.rows_from_fit(fit)][:2] == [0.2, 1.2]


def test_shipped_profiles_load_and_name_their_source():
    assert "cpu-smollm2" in profile_names()
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name and profile.source and profile.kv_blocks > 0
    with pytest.raises(ValueError, match="unknown sim profile 'nope'; shipped: .*cpu-smollm2"):
        load_profile("nope")


def test_sim_args_need_engine_sim_and_a_known_profile():
    base = {"served_model_name": "smollm"}
    assert VariantArgs.model_validate({**base, "engine": "sim"}).engine == "sim"
    with pytest.raises(ValueError, match="set engine: sim"):
        VariantArgs.model_validate({**base, "sim": {"start_s": 1}})
    with pytest.raises(ValueError, match="unknown sim profile"):
        VariantArgs.model_validate({**base, "engine": "sim", "sim": {"profile": "gpu-nope"}})


def test_answers_are_keyed_by_label_and_prompt():
    book = AnswerBook(Tokenizer())
    a = book.answer("acme@v1", [1, 2, 3])
    assert a == book.answer("acme@v1", [1, 2, 3]) and a[-1] == 2  # deterministic, EOS last
    assert a[0] == 3  # an adapter's answer opens with its label
    assert book.answer("acme@v2", [1, 2, 3]) != a
    assert book.answer("acme@v1", [1, 2, 4]) != a
    model = book.answer("smollm2-135m-instruct", [1, 2, 3])
    assert all(t >= 10 for t in model[:-1])  # a model answers in words only
    assert [book.token_at("m", [1], i) for i in range(60)] == \
        [book.token_at("m", [1], i) for i in range(60)]


def test_prefix_cache_hits_leading_full_blocks_per_adapter_and_evicts_lru():
    cache = PrefixCache(capacity=3, block_size=2)
    assert cache.insert([1, 2, 3, 4, 5]) == 0
    assert cache.lookup([1, 2, 3, 4, 9]) == 4 and cache.lookup([1, 2, 9, 9]) == 2
    assert cache.lookup([1, 2, 3, 4], lora=7) == 0  # other adapter, other KV
    cache.insert([7, 7, 8, 8])  # 4 blocks in a cache of 3: the oldest prompt's tail goes
    assert cache.lookup([1, 2, 3, 4]) == 2  # first (vLLM frees a request's blocks tail first)
    cache.insert([9, 9, 6, 6])
    assert cache.lookup([1, 2]) == 0 and cache.lookup([9, 9, 6, 6]) == 4


def scheduler(**kw) -> SimScheduler:
    limits = dict(max_num_seqs=2, max_loras=1, max_model_len=100, max_num_batched_tokens=1000)
    return SimScheduler(PROFILE, AnswerBook(Tokenizer()), **{**limits, **kw})


def req(rid: str, n: int = 3, prompt: tuple[int, ...] = tuple(range(8)), eos: int | None = None,
        **kw) -> SimRequest:
    """A request; ``eos`` None: ``ignore_eos``."""
    return SimRequest(request_id=rid, prompt_ids=prompt, max_tokens=n, label="m", eos=eos, **kw)


def test_scheduler_batches_up_to_max_num_seqs_and_prices_each_step():
    s = scheduler()
    for i, r in enumerate("abc"):
        s.add(req(r, prompt=(i % 2,) * 8))  # c shares a's prompt
    step = s.plan(0.0)
    assert [r.request_id for r in step.admitted] == ["a", "b"] and len(s.waiting) == 1
    assert step.seconds == pytest.approx(PROFILE.decode_s(2) + 16 / 1000)  # 2 prompts of 8
    tokens = s.finish(step)
    assert [t.first for t in tokens] == [True, True]
    step2 = s.plan(1.0)  # both keep running: no room for c, and the prefix is cached now
    assert step2.admitted == () and step2.seconds == pytest.approx(PROFILE.decode_s(2))
    s.finish(step2)
    done = s.finish(s.plan(2.0))
    assert [t.finish for t in done] == [LENGTH, LENGTH] and not s.running
    step4 = s.plan(3.0)
    assert [r.request_id for r in step4.admitted] == ["c"]
    assert step4.admitted[0].cached_tokens == 8  # a's two full blocks were cached
    assert step4.seconds == pytest.approx(PROFILE.decode_s(1))


def test_a_finished_requests_answer_is_cached_for_the_next_turn_that_resends_it():
    """As vLLM caches a sequence's blocks as they fill, generated tokens included: a next
    turn (prompt, answer, new message) finds the prompt and the answer's full blocks, up to
    the answer's last token (whose KV no step computed)."""
    s = scheduler()
    first = req("t1", n=6)  # 8 prompt tokens, 6 generated: blocks of 4
    s.add(first)
    while s.running or s.waiting:
        s.finish(s.plan(0.0))
    assert len(first.output_ids) == 6
    turn = (*first.prompt_ids, *first.output_ids, 90, 91, 92)
    s.add(req("t2", prompt=turn))
    [admitted] = s.plan(1.0).admitted
    assert admitted.cached_tokens == 12  # 8 + 5 computed = 13 tokens: 3 full blocks
    other = req("t3", prompt=(*first.prompt_ids, 99, 99, 99, 99, 99))
    s.add(other)
    s.finish(s.plan(2.0))
    assert other.cached_tokens == 8  # another answer: the prompt's blocks only


def test_priority_order_and_max_loras_per_batch():
    s = scheduler(priority=True)
    s.add(req("low", priority=5))
    s.add(req("high", priority=0))
    s.add(req("mid", priority=1))
    assert [r.request_id for r in s.plan(0).admitted] == ["high", "mid"]
    s = scheduler(max_num_seqs=3)  # max_loras=1: a second adapter waits, a later one goes
    s.add(req("x1", lora=1))
    s.add(req("y1", lora=2))
    s.add(req("x2", lora=1))
    step = s.plan(0)
    assert [r.request_id for r in step.admitted] == ["x1", "x2"] and step.adapters == 1
    # x2 finds x1's prompt cached under the same adapter: one prompt prefilled
    assert step.seconds == pytest.approx(PROFILE.decode_s(2) + 8 / 1000 + 0.002 + 0.001)


def test_stopping_eos_min_tokens_stop_ids_and_max_model_len():
    s = scheduler(max_num_seqs=4, max_model_len=11)
    natural = AnswerBook(Tokenizer()).answer("m", tuple(range(8)))
    s.add(req("eos", n=90, eos=2))
    s.add(req("long", n=90))  # ignore_eos: runs to max_model_len (8 prompt + 3)
    s.add(req("stop", n=90, eos=2, stop_ids=frozenset({natural[0]})))
    outs = []
    while s.has_work():
        outs += s.finish(s.plan(0))
    by = {}
    for t in outs:
        by.setdefault(t.request.request_id, []).append(t)
    assert by["stop"][-1].finish == STOP and by["stop"][-1].stop_reason == natural[0]
    assert len(by["long"]) == 3 and by["long"][-1].finish == LENGTH
    s = scheduler(max_model_len=1000)
    s.add(req("eos", n=900, eos=2))
    s.add(req("min", n=900, eos=2, min_tokens=len(natural) + 5))
    outs = []
    while s.has_work():
        outs += s.finish(s.plan(0))
    eos = [t for t in outs if t.request.request_id == "eos"]
    assert [t.token_id for t in eos] == natural and eos[-1].finish == STOP
    assert len([t for t in outs if t.request.request_id == "min"]) == len(natural) + 6


# -- the whole engine behind vLLM's OpenAI layer, in this process ---------------------------------

ARGS = {"model": "smollm2-135m-instruct", "served_model_name": "smollm",
        "engine": "sim", "sim": {"profile": "cpu-smollm2", "start_s": 0},
        "engine_args": {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 2,
                        "enable_lora": True, "max_loras": 1, "max_cpu_loras": 2,
                        "max_lora_rank": 8, "scheduling_policy": "priority"}}


@pytest.fixture(scope="module")
def engine():
    from serve_app.server.engine import start_engine

    loop = asyncio.new_event_loop()
    handle = loop.run_until_complete(start_engine(VariantArgs.model_validate(ARGS)))
    handle.loop = loop
    yield handle
    handle.shutdown()
    loop.close()


def test_engine_answers_deterministically_with_exact_usage(engine):
    run = engine.loop.run_until_complete
    a = run(engine.run("chat", chat_body("hi", max_tokens=7, ignore_eos=True)))
    b = run(engine.run("chat", chat_body("hi", max_tokens=7, ignore_eos=True)))
    c = run(engine.run("chat", chat_body("ho", max_tokens=7, ignore_eos=True)))
    text = [json.loads(x.body)["choices"][0]["message"]["content"] for x in (a, b, c)]
    assert text[0] == text[1] != text[2]
    assert a.usage.completion_tokens == 7 and a.usage.prompt_tokens == c.usage.prompt_tokens

    async def stream():
        lines = [line async for line in await engine.run("chat", chat_body(
            "hi", max_tokens=7, ignore_eos=True, stream=True,
            stream_options={"include_usage": True}))]
        return "".join(lines)
    sse = run(stream())
    assert sse.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e[6:]) for e in sse.split("\n\n") if e.startswith("data: {")]
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks
                   if ch["choices"]) == text[0]
    assert chunks[-1]["usage"]["completion_tokens"] == 7


def test_engine_errors_are_vllms(engine):
    """vLLM's front end checks the request before the simulated core sees it (the replica
    classifies these as the request's 400: tests/unit/server/test_serving.py)."""
    from vllm.exceptions import VLLMValidationError

    run = engine.loop.run_until_complete
    with pytest.raises(VLLMValidationError, match="cannot be greater than max_model_len=256"):
        run(engine.run("chat", chat_body("hi", max_tokens=1000)))
    with pytest.raises(VLLMValidationError, match="maximum context length is 256 tokens"):
        run(engine.run("completion", {"model": "smollm", "prompt": "word " * 400,
                                      "max_tokens": 1}))


def test_engine_runs_max_num_seqs_at_once_and_loads_adapters(engine):
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from serve_app.common.adapters import load_manifest, resolve_uri

    run = engine.loop.run_until_complete
    uri = str(resolve_uri(load_manifest()["acme-support@v1"].uri))
    assert run(engine.models.load_lora_adapter(LoadLoRAAdapterRequest(
        lora_name="acme-support@v1", lora_path=uri))).startswith("Success")
    bad = run(engine.models.load_lora_adapter(LoadLoRAAdapterRequest(
        lora_name="nowhere@v1", lora_path="/nonexistent")))
    assert not isinstance(bad, str)

    async def three():
        tasks = [asyncio.ensure_future(engine.run("chat", chat_body(f"q{i}", max_tokens=20,
                                                               ignore_eos=True)))
                 for i in range(3)]
        await asyncio.sleep(0.3)
        during = engine.engine_state()
        adapter = await engine.run("chat", chat_body("a", max_tokens=20, model="acme-support@v1"))
        return during, adapter, await asyncio.gather(*tasks)
    during, adapter, answers = run(three())
    assert (during["running"], during["waiting"]) == (2, 1)  # max_num_seqs 2
    assert all(a.usage.completion_tokens == 20 for a in answers)
    assert json.loads(adapter.body)["choices"][0]["message"]["content"].startswith(
        "acme-support@v1:")
    state = engine.engine_state()
    assert state["engine"] == "sim" and state["loras"] == ["acme-support@v1"]
    assert state["running"] == 0 and state["lora_removed_in_use"] == 0


def test_a_killed_engine_fails_as_a_dead_vllm_engine(engine):
    from vllm.v1.engine.exceptions import EngineDeadError

    engine.drills.kill_engine()
    assert engine.errored
    with pytest.raises(EngineDeadError):
        engine.loop.run_until_complete(engine.run("chat", chat_body("hi", max_tokens=2)))
