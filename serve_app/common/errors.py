"""OpenAI-style errors: one exception type and one body format for every failure, the
catalog of every ``error.code`` the mesh sends (:data:`ERROR_CODES`), and how a refused
config or field is reported.

Body format (OpenAI API reference, "Error codes"):
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
An error without a code of its own gets its status phrase (``bad_request``, ...).

``docs/errors.md`` is generated from :data:`ERROR_CODES` (``python
scripts/error_reference.py``); ``tests/unit/docs/test_docs.py`` fails when a code the code can
send is missing from the catalog, or when the committed page is stale.
"""

from __future__ import annotations

from serve_app.common.logs import get_logger

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

logger = get_logger(__name__)

# OpenAI's `type` for each status the mesh returns.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class MeshError(Exception):
    """A request failure with its HTTP status and OpenAI error fields.

    Args:
        status: HTTP status code (400, 401, 403, 404, 413, 415, 429, 503, ...).
        message: what was wrong and how to fix it, for the caller.
        param: the request field at fault, if any (e.g. ``"messages"``).
        code: a short machine-readable code (e.g. ``"model_not_found"``).
        headers: extra response headers (e.g. ``Retry-After`` on 429/503).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def of(cls, verdict, headers: dict[str, str] | None = None) -> MeshError:
        """The error for a :class:`serve_app.common.failures.Verdict`."""
        return cls(verdict.status, verdict.message, param=verdict.param, code=verdict.code,
                   headers=headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """Build the OpenAI error body for ``status`` (type chosen from the status)."""
    if code is None or isinstance(code, int):
        code = HTTPStatus(status).phrase.lower().replace(" ", "_")
    fallback = "server_error" if status >= 500 else "invalid_request_error"
    error_type = _TYPE_BY_STATUS.get(status, fallback)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


#: How pydantic names the members of a union in an error's ``loc`` (``constrained-int``,
#: ``function-after[...]``, ``literal['auto']``, ``str``): schema internals, not fields.
_UNION_TAG = re.compile(r"^(?:[a-z]+(?:-[a-z]+)*\[.*\]|constrained-[a-z]+|lax-or-strict|nullable|"
                        r"str|int|float|bool|bytes|list|dict|tuple|set|frozenset|none|decimal|"
                        r"date|datetime|url|uuid|any)$")
_NO_DATA = object()
_SHOULD = "Input should be "


def _field_path(loc: tuple, data: Any) -> list:
    """``loc`` without pydantic's union-member tags. A part is a tag when it looks like one
    and (with ``data``, the validated input) is not a key of the input at that point, so a
    route named ``int`` stays a field."""
    path, node = [], data
    for part in loc:
        present = node is not _NO_DATA and (
            isinstance(node, dict) and part in node
            or isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if not present and isinstance(part, str) and _UNION_TAG.match(part):
            continue
        path.append(part)
        node = node[part] if present else _NO_DATA
    return path


def _plain(error: dict[str, Any]) -> str:
    """pydantic's message without its ``Value error, `` prefix: our validators' own words."""
    msg = error["msg"]
    for lead in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(lead)
    return msg


def format_validation_error(err: ValidationError, prefix: str = "",
                            data: Any = _NO_DATA) -> str:
    """One line per bad field: ``<path.to.field>: <message>``, in plain words.

    pydantic reports a value that no member of a union accepts once per member, under a
    ``loc`` that names the member (``num_replicas.constrained-int``, ``num_replicas.str``).
    Here the member names are dropped, so is pydantic's ``Value error,`` before a
    validator's own message, a member that refused only the value's type is left
    out when another accepted the type but not the value (``-1`` for ``int > 0 | str``: the
    bound, not "a valid string"), and what is left is one line (``Input should be a valid
    integer or a valid string``).

    Args:
        prefix: the path of the validated value in the file (e.g. ``user_config``).
        data: the validated input, when known: tells member names from fields.
    """
    by_path: dict[str, list[dict[str, Any]]] = {}
    for e in err.errors():
        path = ".".join(str(p) for p in _field_path(tuple(e["loc"]), data))
        where = f"{prefix}.{path}" if prefix and path else (prefix or path or "<root>")
        by_path.setdefault(where, []).append(e)
    lines = []
    for where, errors in by_path.items():
        wrong_type = [e for e in errors if e["type"].endswith(("_type", "_parsing"))
                      or e["type"] in ("literal_error", "enum")]
        if len(wrong_type) < len(errors):
            errors = [e for e in errors if e not in wrong_type]
        msgs = list(dict.fromkeys(_plain(e) for e in errors))
        if len(msgs) > 1 and all(m.startswith(_SHOULD) for m in msgs):
            msgs = [_SHOULD + " or ".join(m[len(_SHOULD):] for m in msgs)]
        lines.append(f"{where}: {'; '.join(msgs)}")
    return "\n".join(lines)


def reject_user_config(last_good: object | None, message: str) -> None:
    """Refuse a new ``user_config`` in ``reconfigure()``.

    With no last good config (a replica's first one) this raises, so a bad first deploy fails
    visibly; otherwise it logs ``message`` and returns, and the caller keeps the last good
    config (raising there would make Serve replace a healthy replica).

    Raises:
        ValueError: ``last_good`` is None.
    """
    if last_good is None:
        raise ValueError(message)
    logger.error("%s\nkeeping the last good user_config", message)


# ---------------------------------------------------------------------------------------------
# The catalog of error codes
# ---------------------------------------------------------------------------------------------

#: ``ErrorCode.retry``: a retry of the same request can succeed later (the response has
#: ``Retry-After``, s); it cannot (change the request or the config first); or the code never
#: reaches a client (the router acts on it: fails over, or tries another variant).
RETRY_AFTER, NO_RETRY, NOT_SENT = "yes, after Retry-After", "no", "not sent"


@dataclass(frozen=True)
class ErrorCode:
    """One ``error.code``: what a client gets, why, and what it should do.

    Attributes:
        status: the HTTP status it comes with.
        cause: what caused it.
        action: what the client (or the operator, when it is the config's fault) should do.
        retry: :data:`RETRY_AFTER`, :data:`NO_RETRY`, :data:`NOT_SENT`, or a sentence.
        source: where it is decided (a module of ``serve_app``, or vLLM).
    """

    status: int
    cause: str
    action: str
    retry: str
    source: str


ERROR_CODES: dict[str, ErrorCode] = {
    # -- 400: the request's own fault ----------------------------------------------------------
    "bad_request": ErrorCode(
        400, "vLLM's own verdict on the request (a missing or invalid field, a prompt longer "
        "than max_model_len, max_tokens < 1 or too large, a template that cannot render), or "
        "a request without a `model`; `param` names the field when known",
        "fix the field the message names", NO_RETRY, "vLLM; request/planner.py"),
    "invalid_json": ErrorCode(
        400, "the body is not JSON, not a JSON object, or nested too deeply (a few hundred "
        "levels)", "send one JSON object", NO_RETRY, "request/body.py, "
        "common/failures.py"),
    "invalid_schema": ErrorCode(
        400, "the structured-output backend cannot apply the request's JSON schema or grammar "
        "(it does not compile, or no token can satisfy it); `param` is `response_format`",
        "simplify the schema (e.g. the `prefixItems` form for tuples)", NO_RETRY,
        "common/failures.py"),
    "priority_not_allowed": ErrorCode(
        400, "the request sets `priority`: the mesh sets it from the tenant's config",
        "remove `priority` from the request", NO_RETRY, "request/planner.py"),
    "unknown_variant": ErrorCode(
        400, "an admin's `x-mesh-variant` header names a variant the route does not have",
        "pin one of the variants the message lists", NO_RETRY, "request/planner.py"),
    "reservation_exceeds_budget": ErrorCode(
        400, "the request reserves more tokens than the tenant's whole token budget: its "
        "prompt bound plus `max_tokens`, or without `max_tokens` the whole context "
        "([what a request reserves](#what-a-request-reserves))", "set a smaller "
        "`max_tokens`; the operator may raise the tenant's tokens_per_minute / "
        "tokens_per_day", NO_RETRY,
        "tenancy/limits.py"),
    "unprocessable_entity": ErrorCode(
        422, "vLLM's verdict: the request is well formed but cannot be processed",
        "fix the request as the message says", NO_RETRY, "vLLM"),
    # -- 401 / 403: who is calling ------------------------------------------------------------
    "invalid_api_key": ErrorCode(
        401, "tenants are configured and the `Authorization: Bearer <key>` header is missing "
        "or its key is unknown", "send a tenant's API key", NO_RETRY, "tenancy/keys.py"),
    "model_not_allowed": ErrorCode(
        403, "the tenant may not call this route (its `routes`)", "call a route the tenant "
        "may call; the operator may add the route to the tenant", NO_RETRY,
        "request/planner.py"),
    "pinning_not_allowed": ErrorCode(
        403, "a non-admin caller sent the `x-mesh-variant` header", "remove the header "
        "(pinning a variant is for admin tenants)", NO_RETRY, "request/planner.py"),
    "admin_only": ErrorCode(
        403, "a non-admin caller asked for an `/admin/*` endpoint, or any caller did in open "
        "mode (no tenants: no admin)", "use an admin tenant's key; in open mode, add "
        "`tenants:` with an admin tenant to the router's config", NO_RETRY, "router.py"),
    # -- 404 / 413 / 415 ----------------------------------------------------------------------
    "model_not_found": ErrorCode(
        404, "the `model` names no route, an adapter the tenant does not own (the same "
        "answer whether another tenant owns it or no one does), or an adapter no variant of "
        "the route serves",
        "call a model `GET /v1/models` lists", NO_RETRY, "request/planner.py"),
    "adapter_not_found": ErrorCode(
        404, "the replica the router chose does not declare the adapter (the router's view "
        "was older than a deploy that removed it)", "call a model `GET /v1/models` lists",
        "maybe: after a deploy, once the router's view of the variants catches up",
        "server/lora.py"),
    "not_found": ErrorCode(
        404, "vLLM's verdict: something the request names does not exist",
        "fix the request as the message says", NO_RETRY, "vLLM"),
    "request_too_large": ErrorCode(
        413, "the body is over 4 MiB", "send a smaller body", NO_RETRY,
        "request/body.py"),
    "unsupported_media_type": ErrorCode(
        415, "`Content-Type` is not `application/json`", "send `Content-Type: "
        "application/json`", NO_RETRY, "request/body.py"),
    # -- 429: the tenant's own limits ---------------------------------------------------------
    "concurrency_limit_exceeded": ErrorCode(
        429, "the tenant has `max_concurrent_requests` in flight, across every router",
        "wait for one of your requests to end", RETRY_AFTER, "tenancy/limits.py"),
    "rate_limit_exceeded": ErrorCode(
        429, "the tenant is over its `requests_per_minute`, across every router",
        "send more slowly", RETRY_AFTER, "tenancy/limits.py"),
    "tokens_exhausted": ErrorCode(
        429, "the tenant's token budget (tokens_per_minute / tokens_per_day) has less left "
        "than the request reserves ([what a request reserves](#what-a-request-reserves)); "
        "the `x-ratelimit-*-tokens` headers say how much",
        "wait, or set a smaller `max_tokens`", RETRY_AFTER, "tenancy/limits.py"),
    # -- 500: a bug -------------------------------------------------------------------------
    "internal_error": ErrorCode(
        500, "an unexpected error inside a live replica, for this request only (it is not "
        "retried on another variant)", "report it with the `x-request-id`; the same request "
        "is likely to fail the same way", NO_RETRY, "common/failures.py, dispatch/dispatcher.py"),
    "internal_server_error": ErrorCode(
        500, "an unexpected error in the router, or vLLM ended a stream with an internal "
        "error (an in-band SSE event)", "report it with the `x-request-id`", NO_RETRY,
        "router.py, common/failures.py"),
    "not_implemented": ErrorCode(
        501, "vLLM's verdict: a feature this server does not have", "do not use that "
        "feature with this mesh", NO_RETRY, "vLLM"),
    # -- 503: the mesh cannot serve it now --------------------------------------------------
    "no_healthy_variant": ErrorCode(
        503, "no variant of the route could take the request: each candidate had a variant "
        "failure (replica dead or unavailable, engine dead, backpressure, a timeout before "
        "the first byte) or was not running; an admin's pinned variant failed",
        "retry after `Retry-After`", RETRY_AFTER, "dispatch/dispatcher.py"),
    "overloaded": ErrorCode(
        503, "the variant is at capacity and its admission queue cannot start the request "
        "within the route's `queue_timeout_s` (decided at arrival); or the variant is "
        "starting from zero replicas and holds as many requests as its first replica can "
        "start within `queue_timeout_s` already", "retry after `Retry-After`, or send less "
        "at once", RETRY_AFTER, "admission/variant_queue.py"),
    "adapter_capacity": ErrorCode(
        503, "the replica's adapter slots (`max_adapters_per_replica`) stayed in use by other "
        "adapters' requests for the route's `queue_timeout_s`, hand-over included (stream or "
        "not): the variant is busy, not broken (no failover, nothing against a rollout)",
        "retry after `Retry-After`",
        RETRY_AFTER, "server/lora.py"),
    "queue_timeout": ErrorCode(
        503, "the request waited in the admission queue past its deadline", "retry after "
        "`Retry-After`", RETRY_AFTER, "admission/variant_queue.py"),
    "shed": ErrorCode(
        503, "the request was queued, and requests of better priority (or a lighter "
        "tenant) took its place before it could start in time", "retry after `Retry-After`",
        RETRY_AFTER, "admission/variant_queue.py"),
    "cold_start_timeout": ErrorCode(
        503, "the variant was at zero replicas and did not start within the route's "
        "`cold_start_timeout_s` (it goes on starting)", "retry after `Retry-After`",
        RETRY_AFTER, "variants/cold_start.py"),
    "cold_start_failed": ErrorCode(
        503, "the variant was at zero replicas and could not be started: its replica failed "
        "to start (the message gives the reason) or did not start within the largest "
        "`cold_start_timeout_s` of its routes; the variant is not started again until "
        "`Retry-After` (a back-off)", "retry after `Retry-After`; the operator reads the "
        "variant's replica log", RETRY_AFTER,
        "variants/cold_start.py"),
    "resident_budget_full": ErrorCode(
        503, "the variant is at zero replicas, the mesh's resident budget (`max_variants`) "
        "is full, and no resident variant is idle enough to evict", "retry after "
        "`Retry-After`", RETRY_AFTER, "variants/resident_budget.py"),
    "limits_unavailable": ErrorCode(
        503, "the tenant has limits and the cluster-wide counts did not answer: its "
        "`limits_fail_mode` is `closed`, or it is `open` and the request reserves more than "
        "the router's share of the budget", "retry after `Retry-After`", RETRY_AFTER,
        "tenancy/limits.py"),
    "controller_unavailable": ErrorCode(
        503, "an `/admin/rollouts` or `/admin/shadows` read: the rollout controller did not "
        "answer", "retry after `Retry-After`", RETRY_AFTER, "router.py"),
    "service_unavailable": ErrorCode(
        503, "the router has no config yet (no routes deployed), or a variant failed in "
        "the middle of a stream (an in-band SSE event: the status was 200)",
        "retry after `Retry-After` (a stream: send the request again)", RETRY_AFTER,
        "router.py, dispatch/relay.py"),
    # -- variant failures the router acts on; a client gets no_healthy_variant ---------------
    "engine_dead": ErrorCode(
        503, "the variant's vLLM engine is dead; Serve replaces the replica",
        "nothing: the router fails over", NOT_SENT, "common/failures.py"),
    "retryable_error": ErrorCode(
        503, "vLLM could not finish the request and says a retry may work",
        "nothing: the router fails over", NOT_SENT, "common/failures.py"),
    "adapter_load_failed": ErrorCode(
        503, "the replica could not load the adapter into its engine (vLLM's reason is in "
        "`/admin/adapters` and the replica log)", "nothing: the router fails over; the "
        "operator reads the replica log", NOT_SENT, "server/lora.py"),
    "injected_fault": ErrorCode(
        503, "the variant's `user_config.fault_injection` failed the request (a test or "
        "drill setting)", "nothing: the router fails over; remove `fault_injection` outside "
        "drills", NOT_SENT, "server/serving.py"),
}
