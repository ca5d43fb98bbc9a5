"""Shadow traffic: mirror a sampled share of a route's requests to another variant, compare
the two answers, and never touch the client.

After the primary variant has been chosen, :meth:`ShadowMirror.maybe_mirror` decides whether
this request is mirrored: the route has a shadow (``routes.<route>.shadow``, or its rollout
is in a shadow phase), the caller is sampled (the same sticky hashing as splits, salted
``route:shadow``), the tenant did not opt out (``shadow: false``), an adapter request's
adapter is served by the shadow, and fewer than ``max_in_flight`` mirrors run and the shadow
is not asleep (scaled to zero, or being evicted; else the mirror is dropped and counted). A mirror is a task of its own:

- it sends the same body to the shadow variant through its ``DeploymentHandle``, streamed
  inside the mesh (so its TTFT can be measured), at vLLM priority :data:`SHADOW_PRIORITY`
  (after every tenant's), without the tenant's limits or an admission slot;
- it waits for the primary's answer, which the request's account captures as it goes to the
  client (the relay keeps the chunks of a mirrored stream; nothing is parsed on the client's
  path);
- it compares the two (:func:`compare`): exact match of the generated text, similarity
  (rapidfuzz's normalized Indel ratio), length ratio, finish reasons, TTFT and latency
  ratios, or the shadow's error; and reports the comparison to the metrics
  (``ray_mesh_shadow_*``) and to the ``RolloutController``, which aggregates it for
  ``GET /admin/shadows`` and judges rollout shadow phases.

The client's answer is the primary's, byte for byte: the mirror runs beside it, and a shadow
that fails or is slow changes nothing but the comparison.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rapidfuzz import fuzz

from serve_app.common.logs import get_logger
from serve_app.common.policies import ShadowConfig
from serve_app.common.wire import Tail, read_head, unbundled
from serve_app.request.planner import RequestPlan
from serve_app.request.split import caller_point

logger = get_logger(__name__)

#: vLLM priority of mirrored requests: after every tenant's (tenants are in -1000..1000).
SHADOW_PRIORITY = 10_000
#: Longest a mirror waits for the shadow's first item (a shadow with no running replica
#: would otherwise hold a mirror slot until one starts), s.
HEAD_TIMEOUT_S = 30
#: Longest a mirror waits for the primary's answer, s.
PRIMARY_TIMEOUT_S = 600


@dataclass(frozen=True)
class Answer:
    """What one side generated (times in s from the request's arrival at the router)."""

    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Comparison:
    """One mirrored pair, compared.

    Attributes:
        route, shadow: the route and the shadow variant.
        primary: the variant that answered the client.
        exact: the generated texts are equal.
        similarity: rapidfuzz ``fuzz.ratio`` / 100 (1.0: equal; 0.0 when the shadow failed).
        length_ratio: shadow / primary text length (characters).
        same_finish: the finish reasons are equal.
        ttft_ratio, latency_ratio: shadow / primary (None when not measurable).
        shadow_error: why the shadow failed, if it did.
        sample: ``(request body, primary text, shadow text)``, only when the route keeps
            samples and the answers disagree.
    """

    route: str
    shadow: str
    primary: str
    exact: bool
    similarity: float
    length_ratio: float | None
    same_finish: bool
    ttft_ratio: float | None
    latency_ratio: float | None
    shadow_error: str | None = None
    sample: tuple[str, str, str] | None = None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(route: str, shadow: str, primary_variant: str, primary: Answer, mirrored: Answer,
            keep_sample_of: str | None = None) -> Comparison:
    """Compare the shadow's answer with the primary's (``keep_sample_of``: the request body
    to keep beside a disagreeing pair, or None to keep nothing)."""
    if mirrored.error is not None:
        return Comparison(route, shadow, primary_variant, False, 0.0, None, False, None, None,
                          mirrored.error)
    exact = mirrored.text == primary.text
    return Comparison(
        route, shadow, primary_variant, exact, fuzz.ratio(primary.text, mirrored.text) / 100,
        _ratio(len(mirrored.text), len(primary.text)),
        mirrored.finish_reason == primary.finish_reason,
        _ratio(mirrored.ttft_s, primary.ttft_s), _ratio(mirrored.latency_s, primary.latency_s),
        sample=(keep_sample_of, primary.text, mirrored.text)
        if keep_sample_of is not None and not exact else None)


def _choice_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    if "message" in choice:
        return choice["message"].get("content") or ""
    return choice.get("text") or ""


def answer_of(json_body: str | None = None, sse: list[str] = (), *, ttft_s: float | None = None,
              latency_s: float = 0.0, error: str | None = None) -> Answer:
    """The generated text and finish reason of an OpenAI answer: a whole JSON body, or the
    SSE chunks of a stream (first choice)."""
    if error is not None:
        return Answer(error=error, latency_s=latency_s)
    text, finish = [], None
    bodies = [json_body] if json_body else [
        line[len("data: "):] for chunk in sse for line in chunk.split("\n")
        if line.startswith("data: {")]
    for raw in bodies:
        data = json.loads(raw)
        if "error" in data:
            return Answer(error=str(data["error"].get("message"))[:300], latency_s=latency_s)
        for choice in data.get("choices") or []:
            if choice.get("index", 0) == 0:
                text.append(_choice_text(choice))
                finish = choice.get("finish_reason") or finish
    return Answer("".join(text), finish, ttft_s, latency_s)


@dataclass
class PrimaryCapture:
    """The primary's answer as it goes to the client: set by the dispatcher (a whole body)
    or kept by the relay (a stream's chunks); ``done`` resolves when the request ends."""

    json_body: str | None = None
    chunks: list[str] = field(default_factory=list)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                 .create_future())

    def answered(self, json_body: str) -> None:
        """The primary's whole answer (a non-stream's body)."""
        self.json_body = json_body

    def relayed(self, chunk: str) -> None:
        """One more chunk of the primary's stream, as the client got it."""
        self.chunks.append(chunk)

    def finish(self, *, ttft_s: float | None, latency_s: float, error: str | None) -> None:
        if not self.done.done():
            self.done.set_result(answer_of(self.json_body, self.chunks, ttft_s=ttft_s,
                                           latency_s=latency_s, error=error))


class ShadowMirror:
    """The mirrors of one router replica.

    Args:
        variants: the router's :class:`~serve_app.variants.registry.VariantRegistry`: each
            variant's handle, whether it serves an adapter, and whether it is at zero
            replicas or being evicted (a mirror would wake it, past the cold start's one
            wake and the resident budget, so it is not mirrored to). The mirrors in flight
            are counted in its ``mirrors``.
        metrics: the router's metrics (``ray_mesh_shadow_*``).
        to_controller: sends a :class:`Comparison` (without its sample) to the controller.
    """

    def __init__(self, variants, metrics, to_controller: Callable[[Comparison], None]) -> None:
        self.variants = variants
        self.serves = variants.availability.serves
        self.asleep = variants.availability.is_asleep
        self.metrics = metrics
        self.to_controller = to_controller
        self.in_flight = variants.mirrors
        self.samples: dict[tuple[str, str], deque] = {}  # disagreeing pairs kept
        self._tasks: set[asyncio.Task] = set()

    def count(self, route: str, shadow: str, outcome: str) -> None:
        self.metrics.shadow_requests.inc(1, {"route": route, "shadow": shadow,
                                             "outcome": outcome})

    def report(self, comparison: Comparison, keep_samples: int) -> None:
        """A mirrored pair was compared: metrics, the controller, the kept samples."""
        self.metrics.record_shadow(comparison)
        self.to_controller(replace(comparison, sample=None))
        if comparison.sample is not None and keep_samples:
            key = (comparison.route, comparison.shadow)
            kept = self.samples.setdefault(key, deque(maxlen=keep_samples))
            body, primary, mirrored = comparison.sample
            kept.append({"request": json.loads(body), "primary": primary, "shadow": mirrored,
                         "similarity": round(comparison.similarity, 4)})

    def status(self, book: dict) -> dict:
        """The controller's aggregates (:class:`~serve_app.control.shadow_book.ShadowBook`)
        with this replica's mirrors in flight and kept samples added."""
        for (route, shadow), kept in self.samples.items():
            book.setdefault(route, {}).setdefault(shadow, {})["samples"] = list(kept)
        for by_shadow in book.values():
            for shadow, figures in by_shadow.items():
                figures["in_flight"] = self.in_flight.get(shadow, 0)
        return book

    def maybe_mirror(self, plan: RequestPlan, shadow: ShadowConfig | None, identity: str | None,
                     request_id: str) -> PrimaryCapture | None:
        """Start a mirror of ``plan`` when it is sampled (see the module docstring); returns
        the capture the primary's account fills, or None."""
        if shadow is None or not plan.candidates or plan.candidates[0] == shadow.application:
            return None
        if plan.tenant is not None and not plan.tenant.shadow:
            return None
        u = caller_point(f"{plan.route}:shadow", identity) if identity else \
            caller_point(f"{plan.route}:shadow", request_id)
        if u * 100 >= shadow.percent:
            return None
        version = None
        if plan.adapter:
            wanted = plan.version or plan.adapter
            if not self.serves(shadow.application, wanted):
                if not self.serves(shadow.application, plan.adapter):
                    return None
                wanted = plan.adapter
            version = wanted if "@" in wanted else None
        if self.in_flight.get(shadow.application, 0) >= shadow.max_in_flight \
                or self.asleep(shadow.application):
            self.count(plan.route, shadow.application, "dropped")
            return None
        capture = PrimaryCapture()
        self.in_flight[shadow.application] = self.in_flight.get(shadow.application, 0) + 1
        task = asyncio.get_running_loop().create_task(
            self._mirror(plan, shadow, version, request_id, capture))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return capture

    async def _mirror(self, plan: RequestPlan, shadow: ShadowConfig, version: str | None,
                      request_id: str, capture: PrimaryCapture) -> None:
        try:
            mirrored = await self._call(plan, shadow.application, version,
                                        f"{request_id}-shadow")
            primary = await asyncio.wait_for(asyncio.shield(capture.done), PRIMARY_TIMEOUT_S)
            if primary.error is not None:
                self.count(plan.route, shadow.application, "primary_failed")
                return
            self.report(compare(plan.route, shadow.application, plan.candidates[0], primary,
                                mirrored, json.dumps(plan.request.body) if shadow.keep_samples else None),
                        shadow.keep_samples)
        except Exception:  # noqa: BLE001 -- a mirror must never surface anywhere else
            logger.exception("shadow mirror of %s to %s failed", plan.route, shadow.application)
        finally:
            self.in_flight[shadow.application] -= 1

    async def _call(self, plan: RequestPlan, application: str, version: str | None,
                    request_id: str) -> Answer:
        """The shadow's answer to the request's body, streamed inside the mesh."""
        t0 = time.monotonic()
        request = replace(plan.request, body={**plan.request.body, "stream": True,
                                              "stream_options": {"include_usage": False}},
                          adapter_version=version, priority=SHADOW_PRIORITY,
                          request_id=request_id)
        ttft, chunks = None, []
        try:
            stream = self.variants.handle(application).options(stream=True).generate.remote(request)
            head = await read_head(stream, HEAD_TIMEOUT_S)
            if head.status != 200:
                return Answer(error=f"HTTP {head.status}: {(head.body or '')[:200]}",
                              latency_s=time.monotonic() - t0)
            async for item in unbundled(stream):
                if isinstance(item, Tail):
                    if item.failure is not None:
                        return Answer(error=item.message[:300], latency_s=time.monotonic() - t0)
                    continue
                ttft = ttft if ttft is not None else time.monotonic() - t0
                chunks.append(item)
        except Exception as e:  # noqa: BLE001 -- the shadow's failure is a comparison result
            return Answer(error=f"{type(e).__name__}: {str(e)[:200]}",
                          latency_s=time.monotonic() - t0)
        return answer_of(sse=chunks, ttft_s=ttft, latency_s=time.monotonic() - t0)


def effective_shadow(configured: ShadowConfig | None, rollout_phase: tuple[str, object] | None
                     ) -> ShadowConfig | None:
    """The shadow a route has now: its rollout's shadow phase (``(canary, ShadowPhase)``)
    while that runs, else the configured one."""
    if rollout_phase is None:
        return configured
    canary, phase = rollout_phase
    return ShadowConfig(application=canary, percent=phase.percent,
                        max_in_flight=phase.max_in_flight)

