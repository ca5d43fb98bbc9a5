"""OpenAI request bodies, and one chat posted to the mesh."""

from __future__ import annotations


def chat_body(content: str = "hi", **fields) -> dict:
    """A chat completion body for route ``smollm`` with one user message, ``content``;
    ``fields`` add keys or replace them (``model``, ``messages``, ``max_tokens``...)."""
    return {"model": "smollm", "messages": [{"role": "user", "content": content}], **fields}


def post_chat(http, *, model: str = "smollm", key: str | None = None, pin: str | None = None,
              user: str | None = None, max_tokens: int = 8, content: str = "What is 2 + 2?",
              timeout: float = 300, **fields):
    """POST one chat to ``/v1/chat/completions`` through ``http`` (an ``httpx.Client`` on the
    mesh); returns the ``httpx.Response``. ``key``: the bearer token; ``pin``: the variant
    (``x-mesh-variant``); ``user``: the body's ``user`` (session affinity); ``fields`` add or
    replace body keys. Temperature 0, so a variant answers the same each time."""
    headers = {**({"authorization": f"Bearer {key}"} if key else {}),
               **({"x-mesh-variant": pin} if pin else {})}
    body = chat_body(content, model=model, temperature=0, max_tokens=max_tokens,
                     **({"user": user} if user else {}), **fields)
    return http.post("/v1/chat/completions", json=body, headers=headers, timeout=timeout)
