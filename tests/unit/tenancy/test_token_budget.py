"""Unit tests of token budgets (no Ray): reservations, buckets, settlement on every ending,
OpenAI's rate-limit headers, and a limiter whose budget holds across two routers."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.common.errors import MeshError
from serve_app.tenancy.counts import TenantCounts
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.quota import Limits
from serve_app.tenancy.token_budget import (CHAT_TEMPLATE_TOKENS, DEFAULT_MAX_TOKENS,
                                            Reservation, TokenBucket, completion_reservation,
                                            duration_header, prompt_bound)
from tests.support.fakes import FakeShared
from tests.support.tenants import tenant

TPM = Limits(tokens_per_minute=600)


def test_a_reservation_is_the_prompt_bound_plus_max_tokens():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
            "max_tokens": 16}
    # (9 + 8) content bytes + (6 + 4) role bytes + the template's allowance + 4 per message
    assert prompt_bound("chat", chat) == 27 + CHAT_TEMPLATE_TOKENS + 8
    assert Reservation.of("chat", chat) == Reservation(35 + CHAT_TEMPLATE_TOKENS, 16)
    assert Reservation.of("chat", chat, max_model_len=64) == Reservation(64, 16)  # capped
    assert prompt_bound("completion", {"prompt": "é" * 6}) == 13  # 12 UTF-8 bytes + a BOS
    assert prompt_bound("completion", {"prompt": [1, 2, 3]}) == 4  # token ids (+ a BOS)
    assert prompt_bound("completion", {"prompt": ["ab", "c" * 99]}, 50) == 3 + 50
    assert completion_reservation({"max_completion_tokens": 7, "max_tokens": 9}) == 7
    assert completion_reservation({}) == DEFAULT_MAX_TOKENS
    assert completion_reservation({"max_tokens": None}) == DEFAULT_MAX_TOKENS


def test_any_body_gets_an_estimate_and_vllm_judges_it():
    """The estimate never fails a request: malformed bodies are vLLM's 400s to give."""
    for body in ({"messages": 5}, {"messages": "hi"}, {"messages": [{"content": {"a": 1}}]},
                 {"messages": [{"content": "\ud800 lone surrogate"}]},
                 {"messages": [{"content": [{"text": None}, 7, "x"]}]}, {"max_tokens": "nine"}):
        assert Reservation.of("chat", body).total >= DEFAULT_MAX_TOKENS
    assert Reservation.of("completion", {"prompt": {"x": 1}}) == Reservation(0, 16)  # vLLM: 16


def test_settled_cost_on_every_ending():
    r = Reservation(prompt=20, completion=100)
    assert r.used(18, 40, streamed_chunks=41) == (18, 40)  # usage known: it wins
    assert r.used(0, 0, streamed_chunks=12) == (20, 12)  # stream left: estimate + chunks
    assert r.used(0, 0, streamed_chunks=0) == (0, 0)  # nothing ran (refused, 400, failed over)


def test_bucket_refills_over_its_window_and_an_excess_is_a_debt_paid_first():
    b = TokenBucket(600, 60.0, now=0.0)
    assert b.wait_s(600, 0.0) == 0 and b.wait_s(601, 0.0) == float("inf")
    b.take(600)
    assert b.wait_s(100, 0.0) == pytest.approx(10.0)  # 10 tokens/s
    assert b.reset_s(30.0) == pytest.approx(30.0)  # 300 back after 30 s, 30 s to full
    b.settle(reserved=0, used=900, now=30.0)  # it cost 900 more than it reserved
    assert b.level == -600.0  # charged, not forgiven: a debt of 600
    assert b.wait_s(100, 30.0) == pytest.approx(70.0)  # the debt, then the request
    b.settle(reserved=10_000, used=0, now=30.0)  # a refund past the limit
    assert b.level == 600.0


def test_a_reservation_bounds_what_vllm_may_generate_for_the_body():
    """Issue 27: the fields vLLM reads, per endpoint, in every form it accepts."""
    def completion(**body):
        return Reservation.of("completion", {"prompt": "hi", **body}).completion

    def chat(max_model_len=0, **body):
        return Reservation.of("chat", {"messages": [], **body}, max_model_len).completion

    # vLLM's completions ignore max_completion_tokens: max_tokens (16 when absent) counts
    assert completion(max_completion_tokens=1, max_tokens=100) == 100
    assert completion(max_completion_tokens=1) == 16
    assert completion(n=4, max_tokens=100) == 400
    assert completion(n=2, best_of=3, max_tokens=10) == 30
    assert completion(prompt=["a", "b", "c"], max_tokens=10) == 30  # one per prompt
    assert completion(prompt=[[1, 2], [3]], n=2, max_tokens=5) == 20
    assert completion(prompt=[1, 2, 3], max_tokens=5) == 5  # one prompt of token ids
    assert completion(max_tokens="100") == completion(max_tokens=100.0) == 100
    assert completion(max_tokens=None) == DEFAULT_MAX_TOKENS  # null: the rest of the context
    # a chat: max_completion_tokens, else max_tokens, else the rest of the context
    assert chat(max_completion_tokens=7, max_tokens=9) == 7
    assert chat(max_completion_tokens=None, max_tokens=" 9 ") == 9
    assert chat(max_model_len=2048) == 2048 and chat() == DEFAULT_MAX_TOKENS
    assert chat(max_model_len=2048, max_tokens=10**9) == 2048  # vLLM's cap
    assert chat(n=3, max_tokens=10) == 30
    assert chat(max_tokens=True) == DEFAULT_MAX_TOKENS  # not an int to vLLM: its 400
    assert Reservation.of("completion", {"prompt": ["abc", "abcdef"]}).prompt == 4 + 7


def test_duration_header_is_openais_format():
    assert [duration_header(s) for s in (0.0064, 0.5, 1, 59.2, 360, 3723)] == [
        "7ms", "500ms", "1s", "1m0s", "6m0s", "1h2m3s"]


def test_over_budget_is_429_tokens_exhausted_with_retry_after_from_the_window():
    now = [0.0]
    counts = TenantCounts(clock=lambda: now[0])
    refusal, quota = counts.acquire("t", TPM, 500)
    assert refusal is None and quota.tokens == (600, 100, pytest.approx(50.0))
    refusal, _ = counts.acquire("t", TPM, 200)
    assert (refusal.status, refusal.code, refusal.retry_after_s) == (429, "tokens_exhausted", 10)
    assert refusal.error().headers == {"Retry-After": "10", "x-ratelimit-limit-tokens": "600",
                                       "x-ratelimit-remaining-tokens": "100",
                                       "x-ratelimit-reset-tokens": "50s"}
    assert "set a smaller max_tokens" in refusal.message
    assert counts.in_flight("t") == 1  # the refused one was not counted
    counts.release("t", reserved=500, used=120)  # settled: 380 back
    assert counts.remaining("t") == {"tokens_per_minute": 480}
    now[0] += 6  # and 60 more from the window
    assert counts.acquire("t", TPM, 540)[0] is None


def test_a_reservation_larger_than_the_whole_budget_is_the_clients_400():
    refusal, _ = TenantCounts().acquire("t", Limits(tokens_per_day=100), 101)
    assert (refusal.status, refusal.code, refusal.retry_after_s) == (
        400, "reservation_exceeds_budget", None)
    assert "Retry-After" not in refusal.error().headers


def test_every_budget_must_fit_and_a_refusal_draws_from_none():
    counts = TenantCounts(clock=lambda: 0.0)
    both = Limits(requests_per_minute=10, tokens_per_minute=1000, tokens_per_day=300)
    assert counts.acquire("t", both, 250)[0] is None
    refusal, quota = counts.acquire("t", both, 100)  # fits the minute, not the day
    assert refusal.code == "tokens_exhausted" and "tokens_per_day" in refusal.message
    assert counts.remaining("t") == {"requests_per_minute": 9, "tokens_per_minute": 750,
                                     "tokens_per_day": 50}
    assert quota.tokens[0] == 1000  # the headers show the per-minute budget


def test_a_lower_limit_after_a_config_change_keeps_what_was_left_up_to_it():
    counts = TenantCounts(clock=lambda: 0.0)
    counts.acquire("t", Limits(tokens_per_minute=1000), 100)
    counts.acquire("t", Limits(tokens_per_minute=500), 0)
    assert counts.remaining("t") == {"tokens_per_minute": 500}
    counts.acquire("t", Limits(tokens_per_minute=2000), 0)
    assert counts.remaining("t") == {"tokens_per_minute": 500}  # no free credit from a raise


def test_two_routers_share_one_budget_and_settle_it():
    async def main():
        shared, t = FakeShared(), tenant(tokens_per_day=1000)
        r1, r2 = TenantLimiter(shared=shared), TenantLimiter(shared=shared)
        a = await r1.acquire(t, 600)
        assert a.reserved == 600 and a.quota.headers()["x-ratelimit-remaining-tokens"] == "400"
        with pytest.raises(MeshError) as e:
            await r2.acquire(t, 600)
        assert (e.value.status, e.value.code) == (429, "tokens_exhausted")
        assert e.value.headers["x-ratelimit-limit-tokens"] == "1000"
        r1.release(a, used=100)  # the request cost 100 of its 600
        await asyncio.sleep(0.01)  # give-backs go out in the background
        b = await r2.acquire(t, 600)
        assert b.quota.tokens[1] == 300
    asyncio.run(main())


def test_a_late_answer_gives_its_reservation_back():
    async def main():
        shared, t = FakeShared(delay_s=0.1), tenant(tokens_per_day=1000)
        asking = asyncio.ensure_future(TenantLimiter(shared=shared).acquire(t, 700))
        await asyncio.sleep(0.02)
        asking.cancel()
        await asyncio.sleep(0.2)
        assert shared.counts.remaining("t") == {"tokens_per_day": 1000}
    asyncio.run(main())


def test_the_prompt_bound_holds_for_smollm2s_own_tokenizer_and_chat_template():
    """Issue 27: the reservation's prompt part is an upper bound, not an estimate, for the
    shipped model: vLLM's own tokenization (the chat template rendered, then encoded without
    special tokens; a completion encoded with them) of ASCII, CJK, emoji, mixed scripts,
    code, token-id prompts and conversations of 1 to 40 messages never exceeds it. (English
    costs ~4 bytes a token, so the bound reserves ~4x English; CJK costs ~2.6 tokens a
    character, which bytes / 3 under-reserved 2.6x.)"""
    import random

    from bench.tokenizer import hf_tokenizer

    tok = hf_tokenizer("smollm2-135m-instruct")
    rng = random.Random(27)
    alphabets = {"ascii": [chr(c) for c in range(32, 127)],
                 "cjk": [chr(c) for c in range(0x4E00, 0x9FFF)],
                 "emoji": [chr(c) for c in range(0x1F300, 0x1F64F)],
                 "mixed": [chr(c) for c in (*range(32, 127), *range(0x0400, 0x04FF),
                                            *range(0x0600, 0x06FF), *range(0x1F300, 0x1F310))],
                 "code": list("def f(x):\n    return {x: [x ** 2]}  # é\t")}
    worst = {}
    for name, alphabet in alphabets.items():
        for _ in range(20):
            texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
                     for _ in range(rng.randint(1, 40))]
            roles = ["system"] + [rng.choice(["user", "assistant"]) for _ in texts[1:]]
            messages = [{"role": r, "content": t} for r, t in zip(roles, texts)]
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False)
            real = len(tok(rendered, add_special_tokens=False)["input_ids"])
            bound = prompt_bound("chat", {"messages": messages})
            assert real <= bound, (name, real, bound, messages[:2])
            prompt = texts[0]
            real_completion = len(tok(prompt)["input_ids"])
            assert real_completion <= prompt_bound("completion", {"prompt": prompt}), name
            worst[name] = max(worst.get(name, 0.0), real / bound)
    ids = [rng.randrange(49152) for _ in range(50)]  # token ids go to vLLM as they are
    assert prompt_bound("completion", {"prompt": ids}) >= len(ids)
    print("\nthe prompt bound's tightest fit (real tokens / bound), per alphabet: "
          + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
