"""Token budgets: what a request reserves, the bucket it draws from, and OpenAI's headers.

A tenant's ``tokens_per_minute`` and ``tokens_per_day`` count prompt plus completion tokens.
Each is a token bucket (the usual rate limiter, as for ``requests_per_minute``): it holds at
most the limit, starts full, and refills at ``limit / window`` tokens per second, so a
window "resets" continuously and is full again one window after it was last drawn from.

A request **reserves** before it runs, when its real size is not known yet:

- prompt tokens: an upper bound, not an average. A byte-level BPE tokenizer (SmolLM2's,
  GPT-2's, Llama 3's, Qwen's) gives every token at least one byte of its text, so a text has
  at most as many tokens as UTF-8 bytes (bytes / 3 would be English's average: CJK text,
  ~2.6 tokens a character with SmolLM2's tokenizer, cost 2.6x that). So: the UTF-8 bytes
  of the prompt text (a token id: one token), for a chat also each message's role and
  :data:`MESSAGE_OVERHEAD_TOKENS` per message (the template's markers around it) plus
  :data:`CHAT_TEMPLATE_TOKENS` (what the template adds once: SmolLM2's default system prompt
  and the generation prompt, 25 tokens), and :data:`PROMPT_SPECIAL_TOKENS` per completion
  prompt; capped at ``max_model_len`` when the route's variants reported it (a longer prompt
  is vLLM's 400, which costs nothing). ``tests/unit/tenancy/test_token_budget.py`` checks the bound
  against SmolLM2's own tokenizer and chat template over ASCII, CJK, emoji and long
  conversations. A model whose template adds more must raise these allowances.
- completion tokens: the most vLLM may generate for that body, read as vLLM reads it
  (``vllm/entrypoints/openai/*/protocol.py``, ``serve/utils/api_utils.get_max_tokens``, vLLM
  0.32): per sequence, for a chat ``max_completion_tokens`` if given, else ``max_tokens``,
  else the rest of the context (``max_model_len``, when the route's variants reported it;
  else :data:`DEFAULT_MAX_TOKENS`); for a completion ``max_tokens``, 16 when absent, the rest
  of the context when null; ``max_completion_tokens`` means nothing to vLLM's completions.
  Each in every form vLLM's protocol accepts (an integer, an integer string such as
  ``"100"``, a float with no fraction), capped at ``max_model_len``. Times ``n`` (and
  ``best_of`` where it is larger), times the number of prompts of a completion (a list of
  strings or of token-id lists).

It **settles** when it ends, however it ends, with the tokens it really cost: vLLM's usage
when the answer carried it; for a stream the client left, or one that failed, the usage of
its last chunk relayed (the replica asks vLLM for ``continuous_usage_stats``: prompt and
completion tokens so far, exact however many tokens vLLM merged into one event); else (no
usage known) the prompt's bound plus one token per streamed event, and 0 when nothing ran.
Settling returns the unused part of the reservation, or draws the excess: what a request
cost beyond its reservation is charged, not forgiven. A bucket may go below 0 (a debt); the
tenant's next request fits only once the refill has paid the debt and its own reservation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Reserved tokens per chat message beyond its role's and content's bytes, for the template's
#: markers around it (SmolLM2's ChatML: ``<|im_start|>``, a newline, ``<|im_end|>``, a
#: newline).
MESSAGE_OVERHEAD_TOKENS = 4
#: Reserved tokens per chat request, for what the chat template adds once (SmolLM2's: a
#: default system prompt and the generation prompt, 25 tokens), with room for a longer one.
CHAT_TEMPLATE_TOKENS = 48
#: Reserved tokens per completion prompt beyond its bytes, for a BOS token the tokenizer may
#: add.
PROMPT_SPECIAL_TOKENS = 1
#: Completion tokens reserved for a request that states no ``max_tokens``.
DEFAULT_MAX_TOKENS = 512
#: Most tokens one request reserves (2**53: exact as a float, above any budget the config
#: allows): a ``max_tokens`` or ``n`` of thousands of digits reserves this, and is refused
#: as ``reservation_exceeds_budget`` (or by vLLM), not overflowed into a float.
MAX_RESERVATION = 2**53
#: Window of each budget, s.
WINDOW_S = {"tokens_per_minute": 60.0, "tokens_per_day": 86400.0}


def _text_tokens(content: Any) -> int:
    """At most how many tokens the text in a prompt or message ``content`` is (str, list of
    parts, or token ids): its UTF-8 bytes, or one per token id."""
    if isinstance(content, str):  # surrogatepass: a lone surrogate is vLLM's 400, not ours
        return len(content.encode("utf-8", "surrogatepass"))
    if isinstance(content, list):
        if content and all(isinstance(t, int) for t in content):  # token ids
            return len(content)
        return sum(_text_tokens(part.get("text", "") if isinstance(part, dict) else part)
                   for part in content)
    return 0


def prompt_bound(endpoint: str, body: dict[str, Any], max_model_len: int = 0) -> int:
    """At most how many prompt tokens a ``chat`` or ``completion`` body is (see the module
    docstring), tokens; per prompt, at most ``max_model_len`` (0: unknown)."""
    def capped(tokens: int) -> int:
        return min(tokens, max_model_len) if max_model_len else tokens

    if endpoint == "chat":
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []  # vLLM answers the 400
        tokens = sum(_text_tokens(m.get("content")) + _text_tokens(m.get("role"))
                     for m in messages if isinstance(m, dict))
        return capped(tokens + CHAT_TEMPLATE_TOKENS + MESSAGE_OVERHEAD_TOKENS * len(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return sum(capped(_text_tokens(p) + PROMPT_SPECIAL_TOKENS) for p in prompt)
    if not isinstance(prompt, (str, list)):
        return 0  # vLLM's 400 to come
    return capped(_text_tokens(prompt) + PROMPT_SPECIAL_TOKENS)


#: A completion's ``max_tokens`` when the body has none (vLLM's ``CompletionRequest``).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def as_int(value: Any) -> int | None:
    """``value`` as vLLM's pydantic protocol (lax mode) reads an ``int`` field: an int, a
    float with no fraction, a string of an integer; None for anything else (vLLM answers
    that with a 400) and for a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _prompts(endpoint: str, body: dict[str, Any]) -> int:
    """Prompts a body has: a completion's list of strings or of token-id lists is one each."""
    prompt = body.get("prompt") if endpoint == "completion" else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def completion_reservation(body: dict[str, Any], endpoint: str = "chat",
                           max_model_len: int = 0) -> int:
    """Completion tokens vLLM may generate for ``body`` at most (see the module docstring).

    Args:
        endpoint: ``chat`` or ``completion``.
        max_model_len: the route's variants' context length, tokens (0: unknown).
    """
    if endpoint == "chat":
        given = next((body[k] for k in ("max_completion_tokens", "max_tokens")
                      if body.get(k) is not None), None)
    else:
        given = body.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    per_sequence = as_int(given) if given is not None else None
    if per_sequence is None or per_sequence <= 0:  # none given (or vLLM's 400 to come)
        per_sequence = max_model_len or DEFAULT_MAX_TOKENS
    elif max_model_len:
        per_sequence = min(per_sequence, max_model_len)
    sequences = max(1, as_int(body.get("n")) or 1, as_int(body.get("best_of")) or 1)
    return min(per_sequence * sequences * _prompts(endpoint, body), MAX_RESERVATION)


@dataclass(frozen=True)
class Reservation:
    """Tokens one request reserves: ``prompt`` (its bound) + ``completion`` (its maximum)."""

    prompt: int = 0
    completion: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    @classmethod
    def of(cls, endpoint: str, body: dict[str, Any], max_model_len: int = 0) -> Reservation:
        """The reservation of ``body`` on ``endpoint`` (``max_model_len``: see
        :func:`completion_reservation`)."""
        return cls(prompt_bound(endpoint, body, max_model_len),
                   completion_reservation(body, endpoint, max_model_len))

    def used(self, prompt_tokens: int, completion_tokens: int,
             streamed_chunks: int) -> tuple[int, int]:
        """(prompt, completion) tokens the request cost: vLLM's usage when known, else the
        prompt's bound and one token per streamed chunk, else (0, 0): nothing ran."""
        if prompt_tokens or completion_tokens:
            return prompt_tokens, completion_tokens
        return (self.prompt, streamed_chunks) if streamed_chunks else (0, 0)


class TokenBucket:
    """One budget: at most ``limit`` tokens, refilled at ``limit / window_s`` per second.

    Args:
        limit: the budget, tokens.
        window_s: the window it is spread over, s.
        now: the clock reading it starts full at, s (monotonic).
    """

    def __init__(self, limit: int, window_s: float, now: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self.level = float(limit)
        self._at = now

    def state(self) -> list[float]:
        """``[limit, window_s, level, at]``: what :meth:`from_state` takes back."""
        return [self.limit, self.window_s, self.level, self._at]

    @classmethod
    def from_state(cls, state: list[float]) -> TokenBucket:
        limit, window_s, level, at = state
        bucket = cls(int(limit), float(window_s), float(at))
        bucket.level = float(level)
        return bucket

    @property
    def rate(self) -> float:
        """Refill rate, tokens/s."""
        return self.limit / self.window_s

    def refill(self, now: float) -> None:
        self.level = min(float(self.limit), self.level + max(0.0, now - self._at) * self.rate)
        self._at = now

    def wait_s(self, tokens: int, now: float) -> float:
        """Seconds until ``tokens`` fit (0: they fit now; inf: never, more than the limit)."""
        self.refill(now)
        if tokens > self.limit:
            return math.inf
        return max(0.0, (tokens - self.level) / self.rate)

    def take(self, tokens: int) -> None:
        """Draw ``tokens`` (after :meth:`wait_s` said they fit)."""
        self.level = max(0.0, self.level - tokens)

    def settle(self, reserved: int, used: int, now: float) -> None:
        """Give back ``reserved - used`` tokens, or draw the excess: below 0 is a debt, paid
        by the refill before the next request fits (:meth:`wait_s`)."""
        self.refill(now)
        self.level = min(float(self.limit), self.level + reserved - used)

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return (self.limit - self.level) / self.rate


def duration_header(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``"20ms"``,
    ``"1s"``, ``"6m0s"``, ``"1h2m3s"`` (whole seconds above 1 s, rounded up)."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
