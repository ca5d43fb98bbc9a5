"""Whatever a client sends, the router answers 4xx or serves it, never 500 (no Ray): every
body field and header the router reads, in every JSON shape and with odd bytes, through the
steps the router runs before dispatch (authenticate, read the body, label, plan, reserve
tokens, take the tenant's slot, size the request for admission). A body is read against its
limit as it streams in: a chunked body over the limit is refused before it is all read."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from serve_app.common.config import RouterConfig
from serve_app.common.errors import MeshError
from serve_app.request.planner import RequestPlanner
from serve_app.request.body import MAX_REQUEST_BYTES, read_json_body
from serve_app.request.split import splits_of
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.dispatch.account import RequestAccount
from serve_app.tenancy.keys import authenticate, hash_api_key
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.token_budget import Reservation
from tests.support.bodies import chat_body
from tests.support.fakes import FakePlannerAvailability, NullMetrics

KEY = "sk-acme"
CONFIG = RouterConfig.model_validate({
    "routes": {"smollm": {"variants": [{"application": "v1", "weight": 1}]}},
    "tenants": [{"id": "acme", "api_keys_sha256": [hash_api_key(KEY)], "adapters": ["acme"],
                 "tokens_per_day": 10_000, "max_concurrent_requests": 100}]})


def request(raw: bytes, headers: dict[str, str] | None = None,
            chunks: list[bytes] | None = None) -> tuple[Request, list[int]]:
    """A Starlette request whose body arrives as ``chunks`` (default: ``raw`` at once);
    the second value counts the chunks the server was asked for."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}",
               **(headers or {})}
    pending, asked = list(chunks if chunks is not None else [raw]), [0]

    async def receive():
        asked[0] += 1
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
    return Request(scope, receive), asked


async def front(req: Request, endpoint: str = "chat") -> None:
    """What ``MeshRouter._serve`` runs before dispatch, in its order."""
    tenants = CONFIG.tenant_by_key_digest()
    planner = RequestPlanner(CONFIG, splits_of(CONFIG), lambda key, split: split.weighted,
                             FakePlannerAvailability({"v1": {"acme@v1"}}))
    account = RequestAccount(NullMetrics(), lambda *a, **k: None, planner.labels(None, None),
                             "id-1")
    tenant = authenticate(tenants, req.headers.get("authorization"))
    body = await read_json_body(req)
    account.labelled(planner.labels(tenant, body))
    plan = await planner.plan(endpoint, body, tenant, request_id="id-1",
                              session_id=req.headers.get("x-session-id"),
                              pinned=req.headers.get("x-mesh-variant"))
    account.labelled(plan.tags, plan.arms)
    await account.hold_tenant_slot(TenantLimiter(shared=None), tenant,
                                   Reservation.of(endpoint, body, 0))
    await VariantAdmission("v1").take(account.ask(plan.priority, plan.top_priority,
                                                  plan.stream))  # what admission reads of it
    account.finish(200)


def outcome(raw: bytes, headers: dict[str, str] | None = None, endpoint: str = "chat") -> int:
    """200 when the request passes the router's front, else its MeshError's status (any
    other exception fails the test: it would be a 500)."""
    try:
        asyncio.run(front(request(raw, headers)[0], endpoint))
    except MeshError as e:
        return e.status
    return 200


def chat(**fields) -> bytes:
    """A chat body with ``fields``, as the client sends it."""
    return json.dumps(chat_body(**fields)).encode()


BIG = 10**4000  # within Python's int-string limit (4300 digits): a valid JSON number


@pytest.mark.parametrize("raw", [
    chat(user="\ud800"),  # a lone surrogate (JSON "\ud800"): UnicodeEncodeError in split
    chat(user="\udfff" * 3, max_tokens=1),
    chat(max_tokens=BIG), chat(max_completion_tokens=BIG), chat(n=BIG), chat(best_of=BIG),
    chat(max_tokens=str(BIG)), chat(max_tokens=1e308), chat(max_tokens=-BIG),
    chat(n=BIG, max_tokens=BIG),
    chat(messages=[{"role": {"x": 1}, "content": [{"type": "text", "text": 123}]}]),
    chat(messages=[1, None, "x", [], {"content": {"a": [1]}}]), chat(messages="hi"),
    chat(messages=[{"role": "user", "content": [None, 5, {"text": None}, {"text": [1]}]}]),
    chat(stream="yes"), chat(stream=True, stream_options="x"), chat(priority=[1]),
    chat(priority=BIG), chat(user=["a"]), chat(user={"a": 1}),
    chat(model="smollm:" + "x" * 100_000), chat(model=":"), chat(model="smollm:acme@"),
    chat(model={"a": 1}),
    b'{"model": "smollm", "max_tokens": ' + b"9" * 5000 + b"}",  # past the int-string limit
    b'{"model": "smollm", "max_tokens": 1e400}', b'{"model": "smollm", "n": NaN}',
    b'{"model": "smollm", "user": "\\udc80\\ud800"}', b"\xff\xfe", b"[1]", b"",
])
def test_no_body_a_client_sends_is_a_500(raw):
    assert outcome(raw) in (200, 400, 403, 404)
    assert outcome(raw, endpoint="completion") in (200, 400, 403, 404)


@pytest.mark.parametrize("endpoint, fields", [
    ("completion", {"prompt": [[1, "a"], None]}), ("completion", {"prompt": {"a": 1}}),
    ("completion", {"prompt": [None]}), ("completion", {"prompt": ["x"] * 10, "n": BIG}),
])
def test_no_prompt_shape_is_a_500(endpoint, fields):
    raw = json.dumps({"model": "smollm", **fields}).encode()
    assert outcome(raw, endpoint=endpoint) in (200, 400, 403, 404)


def test_a_huge_reservation_is_the_budget_s_400_not_an_overflow():
    assert outcome(chat(max_tokens=BIG)) == 400
    with pytest.raises(MeshError) as e:
        asyncio.run(front(request(chat(n=BIG, max_tokens=BIG))[0]))
    assert e.value.code == "reservation_exceeds_budget"


def test_a_5000_digit_integer_is_invalid_json():
    raw = b'{"model": "smollm", "max_tokens": ' + b"9" * 5000 + b"}"
    with pytest.raises(MeshError) as e:
        asyncio.run(read_json_body(request(raw)[0]))
    assert (e.value.status, e.value.code) == (400, "invalid_json")


@pytest.mark.parametrize("headers", [
    {"x-session-id": "\xff\xfe\x00"}, {"x-session-id": "s" * 100_000},
    {"x-mesh-variant": "\xff"}, {"x-mesh-variant": "v1\n"},
    {"authorization": "Bearer \xff\xfe"}, {"authorization": "\xff"}, {"authorization": ""},
    {"content-length": "\xb2"},  # "²": str.isdigit() says yes, int() says no
    {"content-length": "9" * 5000},
])
def test_no_header_a_client_sends_is_a_500(headers):
    assert outcome(chat(), headers) in (200, 400, 401, 403, 404, 413)


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    """No Content-Length, 200 chunks of 1 MiB: 413 after 5 chunks, not after all 200."""
    chunk = b" " * (1024 * 1024)
    req, asked = request(b"", {}, chunks=[chunk] * 200)
    with pytest.raises(MeshError) as e:
        asyncio.run(read_json_body(req))
    assert (e.value.status, e.value.code) == (413, "request_too_large")
    assert asked[0] == MAX_REQUEST_BYTES // len(chunk) + 1


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    req, asked = request(chat(), {"content-length": str(MAX_REQUEST_BYTES + 1)})
    with pytest.raises(MeshError) as e:
        asyncio.run(read_json_body(req))
    assert e.value.status == 413 and asked[0] == 0
