"""One classification of every way a request can fail, used by the replica and the router.

There are three kinds of failure, and each has its own consequences:

=============  ==========================================  ========  ===========  ===========
kind           cause                                       status    fails over?  counts
                                                                                  against the
                                                                                  arm?
=============  ==========================================  ========  ===========  ===========
``REQUEST``    the request's own content: vLLM validation  4xx       no           no
               errors of every class, pydantic errors,
               tokenizer and chat-template errors, a
               structured-output schema the grammar
               backend cannot compile, nesting too deep
``VARIANT``    the variant cannot serve: replica actor     503 +     yes, before  yes
               dead or unavailable, engine dead, Serve     Retry-    the first
               backpressure, a timeout before the first    After     byte
               byte, an injected fault (drills)
``CAPACITY``   the variant is busy, not broken: a request  503 +     no           no
               waited ``queue_timeout_s`` for an adapter   Retry-
               slot on its replica                         After
``INTERNAL``   an unexpected exception inside a live       500       no           no
               replica
=============  ==========================================  ========  ===========  ===========

So no client can make a healthy variant look broken (a rollout never sees its bad requests),
and a poison request that crashes our code costs one 500, not one per variant.

The 4xx statuses, messages and ``param`` of request errors are vLLM's own
(``vllm.entrypoints.serve.exception_handling.error_response.create_error_response``, the
function ``vllm serve`` uses), so the mesh answers what vLLM's OpenAI server answers.
"""

from __future__ import annotations

import asyncio
import enum
import json
import pickle
from dataclasses import dataclass

from serve_app.common.errors import error_body, format_validation_error


#: Seconds a client is told to wait (``Retry-After``) when the mesh cannot serve it now for
#: its own reasons: no variant could take the request (every candidate had a variant
#: failure), the router has no config yet, or the rollout controller did not answer.
#: Refusals with a computed wait (admission, tenant limits) say that wait instead.
RETRY_AFTER_S = 5


class Failure(str, enum.Enum):
    """Kind of a failed request; see the module docstring for what each kind causes."""

    REQUEST = "request_error"
    VARIANT = "variant_failure"
    CAPACITY = "capacity"
    INTERNAL = "internal_error"


@dataclass(frozen=True)
class Verdict:
    """A failure with the OpenAI error the client gets for it.

    Attributes:
        failure: its kind.
        status: HTTP status (4xx for ``REQUEST``, 503 for ``VARIANT``, 5xx for ``INTERNAL``).
        message: what went wrong and, where the client can, how to fix it.
        param: the request field at fault, if known (OpenAI ``error.param``).
        code: OpenAI ``error.code``; None gives the status phrase (``bad_request``).
    """

    failure: Failure
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        """The OpenAI error body (:func:`serve_app.common.errors.error_body`)."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def engine_dead(variant: str) -> Verdict:
    return Verdict(Failure.VARIANT, 503, f"variant {variant}'s engine is not running; the "
                   "replica is being replaced, retry", code="engine_dead")


def vllm_validation_verdict(exc) -> Verdict:
    """The 400 ``vllm serve`` answers for a body its protocol class refuses, unchanged.

    vLLM's server has FastAPI parse the body into its request class (``ChatCompletionRequest``
    ...), which turns pydantic's errors into a ``RequestValidationError`` whose ``loc`` starts
    with ``"body"`` (FastAPI's ``_regenerate_error_with_loc``); vLLM's handler
    (``vllm.entrypoints.serve.exception_handling.handlers.validation``) writes the message
    and ``param`` from it. The replica validates the same class itself, so it runs the same
    handler on the same errors: status, message and ``param`` are vLLM's.

    Args:
        exc: the ``pydantic.ValidationError`` of ``<Request class>.model_validate(body)``.
    """
    from types import SimpleNamespace

    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        validation_exception_handler)

    errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
    # The handler reads only app.state.args.log_error_stack and, when that is set, the
    # request's id: a stand-in request is enough.
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(
        args=SimpleNamespace(log_error_stack=False))), state=SimpleNamespace())
    handling = validation_exception_handler(request, RequestValidationError(errors))
    try:  # it awaits nothing: run it to its end here, synchronously
        handling.send(None)
    except StopIteration as done:
        answer = done.value
    else:  # pragma: no cover -- a future vLLM that awaits inside: our own wording
        handling.close()
        return Verdict(Failure.REQUEST, 400, format_validation_error(exc))
    error = json.loads(answer.body)["error"]
    return Verdict(Failure.REQUEST, answer.status_code, error["message"],
                   param=error.get("param"))


def replica_verdict(exc: BaseException, *, variant: str, engine_is_dead: bool,
                    structured_output: bool) -> Verdict:
    """Classify an exception raised inside an ``LLMReplica`` while serving one request.

    Args:
        exc: what vLLM's serving layer (or our code around it) raised.
        variant: the replica's application, for messages.
        engine_is_dead: the replica's engine has died (``AsyncLLM.errored``).
        structured_output: the request asked for structured output (``response_format``
            json_schema / json_object, ``structured_outputs``, ``guided_*``).
    """
    from pydantic import ValidationError
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import GenerationError, RetryableRequestError
    from vllm.v1.engine.exceptions import EngineDeadError

    if engine_is_dead or isinstance(exc, EngineDeadError):
        return engine_dead(variant)
    if isinstance(exc, ValidationError):
        return vllm_validation_verdict(exc)
    if isinstance(exc, RecursionError):
        return nested_too_deeply()
    if isinstance(exc, RetryableRequestError):
        return Verdict(Failure.VARIANT, 503, f"variant {variant} could not finish the request "
                       f"({exc}); retry", code="retryable_error")
    if isinstance(exc, GenerationError) and structured_output:
        # On one engine with no KV connector, a generation that ends with finish_reason
        # "error" is the grammar backend refusing the request's schema (compile failure, or
        # a grammar that rejects every token): the request's own fault.
        return grammar_failed()
    err = create_error_response(exc).error  # vLLM's own verdict: 4xx for client errors
    if 400 <= err.code < 500 or err.code == 501:  # 501: a feature this server lacks
        return Verdict(Failure.REQUEST, err.code, err.message, param=err.param)
    return Verdict(Failure.INTERNAL, 500, f"internal error in variant {variant}: "
                   f"{type(exc).__name__}: {err.message}"[:2000], code="internal_error")


def grammar_failed() -> Verdict:
    return Verdict(Failure.REQUEST, 400, "the structured-output backend could not apply the "
                   "requested schema (it failed to compile, or no token can satisfy it); "
                   "simplify the JSON schema or grammar, e.g. use the `prefixItems` form "
                   "for tuples", param="response_format", code="invalid_schema")


def nested_too_deeply() -> Verdict:
    return Verdict(Failure.REQUEST, 400, "request body is nested too deeply; send a body "
                   "of at most a few hundred levels of nesting", code="invalid_json")


def stream_error_verdict(code: int, message: str, *, variant: str, engine_is_dead: bool,
                         structured_output: bool) -> Verdict:
    """Classify an in-band SSE error event (``data: {"error": {...}}``) that vLLM sent after
    the stream had started (so after the HTTP status went out).

    Args:
        code: the event's ``error.code`` (an HTTP status).
        message: its ``error.message``.
    """
    if engine_is_dead:
        return engine_dead(variant)
    if 400 <= code < 500:
        return Verdict(Failure.REQUEST, code, message)
    if structured_output:
        return grammar_failed()
    return Verdict(Failure.INTERNAL, code if code >= 500 else 500, message)


def replica_gone(exc: BaseException) -> bool:
    """Whether a handle call failed because its replica died or cannot be reached (Ray's
    ``RayActorError``: ``ActorDiedError``, ``ActorUnavailableError``)."""
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def queue_full(exc: BaseException) -> bool:
    """Whether Serve's handle refused a call because the deployment's queue is full
    (``BackPressureError``: ``max_queued_requests`` reached). The call never reached a
    replica: it says nothing of a replica's health."""
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError)


def handle_failure(exc: BaseException) -> Failure:
    """Classify an exception from a router -> replica ``DeploymentHandle`` call.

    The replica turns every error of its own into an answer (see :func:`replica_verdict`),
    so an exception here means the call itself failed: the actor died or is unreachable,
    Serve refused it (backpressure), it timed out, or the arguments could not be sent.
    """
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, RecursionError) or (
            isinstance(exc, pickle.PicklingError) and "recursion" in str(exc)):
        return Failure.REQUEST  # serializing a deeply nested body (Ray's or gRPC's path)
    if isinstance(exc, (RayActorError, BackPressureError, DeploymentUnavailableError,
                        asyncio.TimeoutError, TimeoutError)):
        return Failure.VARIANT
    # A RayTaskError subclasses the exception it wraps; match vLLM's by name so the router
    # need not import vLLM.
    if any(c.__name__ == "EngineDeadError" for c in type(exc).__mro__):
        return Failure.VARIANT
    if isinstance(exc, RayTaskError):  # our replica code raised: a bug, not the variant
        return Failure.INTERNAL
    return Failure.VARIANT  # e.g. a Ray system error on the way: try another variant
