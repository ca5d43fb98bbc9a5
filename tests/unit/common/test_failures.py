"""A body vLLM's protocol refuses gets vLLM's own status, message and ``param`` from the
replica: each case is sent both to vLLM's own HTTP layer (a FastAPI app with vLLM's request
classes and exception handlers, as ``vllm serve`` builds it) and through the replica's
classification (:func:`serve_app.common.failures.replica_verdict`), and the two must agree."""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' body classes
# from their annotations at run time.
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from serve_app.common.failures import Failure, replica_verdict

MESSAGES = [{"role": "user", "content": "hi"}]

#: (endpoint, body) pairs that vLLM's request classes refuse.
BAD_BODIES = [
    ("chat", {"model": "m", "messages": MESSAGES, "seed": 2 ** 70}),  # less_than_equal
    ("chat", {"model": "m", "messages": MESSAGES, "seed": -2 ** 70}),
    ("chat", {"model": "m", "messages": MESSAGES, "temperature": "hot"}),
    ("chat", {"model": "m"}),  # messages missing
    ("chat", {"model": "m", "messages": "hi"}),
    ("chat", {"model": "m", "messages": MESSAGES, "stop": [1, 2]}),
    ("chat", {"model": "m", "messages": MESSAGES, "top_logprobs": "many"}),
    ("completion", {"model": "m", "prompt": "hi", "seed": 2 ** 64}),
    ("completion", {"model": "m"}),  # prompt missing
    ("completion", {"model": "m", "prompt": "hi", "max_tokens": "many"}),
]


@pytest.fixture(scope="module")
def vllm_http() -> TestClient:
    """vLLM's OpenAI HTTP layer for validation: its request classes as FastAPI bodies and
    its exception handlers (``init_exception_handler``), nothing behind them."""
    from types import SimpleNamespace

    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.state.args = SimpleNamespace(log_error_stack=False)
    init_exception_handler(app)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest):  # noqa: ARG001 -- never reached
        return {}

    @app.post("/v1/completions")
    async def completion(request: CompletionRequest):  # noqa: ARG001
        return {}
    return TestClient(app)


def _replica_verdict(endpoint: str, body: dict):
    cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    # What the replica's engine handle does with a body: pydantic's errors, and the
    # VLLMValidationError some of vLLM's model validators raise themselves.
    with pytest.raises(Exception) as refused:
        cls.model_validate(body)
    return replica_verdict(refused.value, variant="v", engine_is_dead=False,
                           structured_output=False)


@pytest.mark.parametrize("endpoint,body", BAD_BODIES)
def test_a_body_vllm_refuses_gets_vllms_status_message_and_param(vllm_http, endpoint, body):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    answer = vllm_http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    vllm_error = answer.json()["error"]
    verdict = _replica_verdict(endpoint, body)
    assert verdict.failure is Failure.REQUEST
    assert (verdict.status, verdict.message, verdict.param) == (
        answer.status_code, vllm_error["message"], vllm_error["param"])


def test_an_out_of_range_seed_names_pydantics_error_type():
    """The case the mesh reworded: vLLM's message names ``less_than_equal``."""
    verdict = _replica_verdict("chat", {"model": "m", "messages": MESSAGES, "seed": 2 ** 70})
    assert "less_than_equal" in verdict.message and verdict.param == "body.seed"
