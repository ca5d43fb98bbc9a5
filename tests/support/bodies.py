"""OpenAI request bodies for unit tests."""

from __future__ import annotations


def chat_body(content: str = "hi", **fields) -> dict:
    """A chat completion body for route ``smollm`` with one user message, ``content``;
    ``fields`` add keys or replace them (``model``, ``messages``, ``max_tokens``...)."""
    return {"model": "smollm", "messages": [{"role": "user", "content": content}], **fields}
