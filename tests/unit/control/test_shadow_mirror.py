"""Unit tests of shadow traffic (no Ray: a fake handle answers): sampling, opt-out, the
in-flight cap, comparison figures, and the rollout's shadow phase verdicts."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from serve_app.common.config import RouterConfig
from serve_app.common.policies import RolloutPolicy, ShadowConfig
from serve_app.common.wire import GenerateRequest, Head, Tail, Usage
from serve_app.request.planner import RequestPlan
from serve_app.control.shadow_mirror import Answer, ShadowMirror, answer_of, compare
from serve_app.control.rollout import Rollout
from tests.support.fakes import registry_of

TENANTS = {t.id: t for t in RouterConfig.model_validate({
    "routes": {"r": {"variants": [{"application": "v1", "weight": 1}]}},
    "tenants": [{"id": "a", "api_keys_sha256": ["1" * 64]},
                {"id": "quiet", "api_keys_sha256": ["2" * 64], "shadow": False}]}).tenants}


def sse(*words: str, finish: str = "length") -> list[str]:
    chunks = [f'data: {{"choices":[{{"index":0,"delta":{{"content":"{w}"}}}}]}}\n\n'
              for w in words]
    chunks.append(f'data: {{"choices":[{{"index":0,"delta":{{}},"finish_reason":"{finish}"}}]}}'
                  "\n\ndata: [DONE]\n\n")
    return chunks


def test_answers_from_bodies_and_streams():
    body = json.dumps({"choices": [{"index": 0, "message": {"content": "Paris."},
                                    "finish_reason": "stop"}]})
    assert answer_of(body) == Answer("Paris.", "stop")
    assert answer_of(sse=sse("Par", "is.")).text == "Paris."
    assert answer_of(sse=['data: {"error": {"message": "engine died", "code": 500}}\n\n']
                     ).error == "engine died"


def test_comparison_figures():
    same = compare("r", "v2", "v1", Answer("The capital is Paris.", "stop", 0.1, 1.0),
                   Answer("The capital is Paris.", "stop", 0.2, 1.5))
    assert same.exact and same.similarity == 1.0 and same.same_finish
    assert (same.ttft_ratio, same.latency_ratio, same.length_ratio) == (2.0, 1.5, 1.0)
    french = compare("r", "v2", "v1", Answer("The capital is Paris.", "stop", 0.1, 1.0),
                     Answer("La capitale est Paris.", "stop", 0.1, 1.0), keep_sample_of="{}")
    assert not french.exact and 0.3 < french.similarity < 0.9
    assert french.sample == ("{}", "The capital is Paris.", "La capitale est Paris.")
    failed = compare("r", "v2", "v1", Answer("x"), Answer(error="HTTP 503"))
    assert failed.shadow_error == "HTTP 503" and failed.similarity == 0.0


class FakeStreamingHandle:
    """A variant's deployment handle whose ``generate`` streams ``words`` (a head, the SSE
    chunks, a tail) after ``delay_s``; records each call."""

    def __init__(self, words, delay_s=0.0):
        self.words, self.delay_s, self.calls = words, delay_s, []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return SimpleNamespace(remote=self._remote)

    def _remote(self, *args):
        self.calls.append(args)

        async def stream():
            await asyncio.sleep(self.delay_s)
            yield Head(200, stream=True)
            for chunk in sse(*self.words):
                yield chunk
            yield Tail(Usage(1, len(self.words)))
        return stream()


class Metrics:
    def __init__(self):
        self.outcomes, self.recorded = [], []
        self.shadow_requests = SimpleNamespace(inc=lambda n, tags: self.outcomes.append(
            tags["outcome"]))

    def record_shadow(self, c):
        self.recorded.append(c)


def plan(tenant="a", **kw) -> RequestPlan:
    return RequestPlan(request=GenerateRequest("chat", {"model": "r", "messages": []}),
                       route="r", adapter="", candidates=("v1",), arms=(("r", ""),),
                       tenant=TENANTS[tenant], top_priority=True, queue_timeout_s=30, **kw)


def test_mirror_sampling_cap_opt_out_and_comparison():
    async def main():
        handle, metrics, sent = FakeStreamingHandle(["Par", "is."], delay_s=0.05), Metrics(), []
        mirror = ShadowMirror(registry_of(lambda app: handle), metrics, sent.append)
        everyone = ShadowConfig(application="v2", percent=100, max_in_flight=2)
        nobody = ShadowConfig(application="v2", percent=0)
        assert mirror.maybe_mirror(plan(identity="u"), nobody, "u", "id") is None
        assert mirror.maybe_mirror(plan("quiet"), everyone, "u", "id") is None  # opted out
        captures = [mirror.maybe_mirror(plan(), everyone, f"u{i}", f"id{i}") for i in range(3)]
        assert captures[2] is None and metrics.outcomes == ["dropped"]  # max_in_flight 2
        await asyncio.sleep(0)  # the mirror tasks start
        assert [c[0].priority for c in handle.calls] == [10_000, 10_000]  # low vLLM priority
        assert [c[0].request_id for c in handle.calls] == ["id0-shadow", "id1-shadow"]
        for capture, chunks in zip(captures[:2], (sse("Par", "is."), sse("Rome."))):
            capture.chunks.extend(chunks)
            capture.finish(ttft_s=0.1, latency_s=0.2, error=None)
        await asyncio.sleep(0.2)
        assert mirror.in_flight == {"v2": 0}
        assert sorted(c.exact for c in metrics.recorded) == [False, True]
        assert len(sent) == 2 and all(c.sample is None for c in sent)
    asyncio.run(main())


def test_rollout_shadow_phase_passes_or_rolls_back_before_any_weight():
    def comparisons(exact: bool, n: int):
        return [compare("r", "canary", "stable", Answer("a b c", "stop", 0.1, 1.0),
                        Answer("a b c" if exact else "x y z", "stop", 0.1, 1.1))
                for _ in range(n)]

    policy = RolloutPolicy.model_validate({"steps": [50, 100], "min_requests": 2,
                                           "shadow": {"min_requests": 5}})
    for exact, state, decision in ((True, "progressing", "shadow-pass"),
                                   (False, "rolled_back", "rollback")):
        r = Rollout("r", "stable", "canary", policy, now=0)
        assert r.state == "shadowing" and r.weights() == {"stable": 100, "canary": 0}
        for c in comparisons(exact, 4):
            r.observe_shadow(c)
        assert r.evaluate(1) is None  # 4 < min_requests
        r.observe_shadow(comparisons(exact, 1)[0])
        d = r.evaluate(2)
        assert (r.state, d["decision"]) == (state, decision), d["reason"]
        assert d["shadow"]["compared"] == 5
        if exact:
            assert r.weights() == {"stable": 50, "canary": 50}
        else:
            assert d["reason"].startswith("shadow phase: agreement 0.0% < 80.0%")
            assert r.weights()["canary"] == 0
