"""What a simulated engine says: deterministic token ids keyed by who answers and what.

An answer is words, then the tokenizer's EOS; an adapter's answer starts with
``<name@vN>:``. ``label`` names what answers: the adapter version for a LoRA request
(``acme-support@v1``), the merged adapter for a merged model's own weights (so a merged
variant answers exactly as the LoRA path does, as the real weights do), else the model
(``smollm2-135m-instruct``; a model's label is not written, to keep short answers words).
The words and the answer's length are drawn from a hash of the label and the prompt's token
ids, which hold the chat template and the system prompt. So the same request to the same
adapter, version or model always gets the same tokens, and tests can tell from the text which
adapter version answered.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Any

#: Words per answer before EOS (uniform in this range, by the hash).
MIN_WORDS, MAX_WORDS = 6, 40

_WORD = re.compile(r"^ [a-z]{3,9}$")


@lru_cache(maxsize=8)
def _words(tokenizer: Any) -> tuple[int, ...]:
    """Token ids that decode to one plain lowercase word with a leading space, by id."""
    ids = []
    for token_id in sorted(tokenizer.get_vocab().values()):
        if _WORD.match(tokenizer.decode([token_id])):
            ids.append(token_id)
        if len(ids) >= 4096:
            break
    if not ids:
        raise ValueError("the tokenizer has no plain-word tokens for the simulated engine")
    return tuple(ids)


class AnswerBook:
    """Deterministic answers for one tokenizer.

    Args:
        tokenizer: the model's tokenizer (vLLM's, or any with ``encode``, ``decode``,
            ``get_vocab`` and ``eos_token_id``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.words = _words(tokenizer)
        self.eos = tokenizer.eos_token_id

    @lru_cache(maxsize=1024)
    def _label_ids(self, label: str) -> tuple[int, ...]:
        if "@v" not in label:  # a model answers in words only
            return ()
        return tuple(self.tokenizer.encode(f"{label}:", add_special_tokens=False))

    def answer(self, label: str, prompt_ids: list[int] | tuple[int, ...]) -> list[int]:
        """The whole answer to ``prompt_ids`` by ``label``: its token ids, EOS last.

        The engine cuts it at ``max_tokens`` and, with ``ignore_eos``, continues it with
        :meth:`token_at` past the EOS."""
        seed = self._seed(label, prompt_ids)
        n_words = MIN_WORDS + seed % (MAX_WORDS - MIN_WORDS + 1)
        head = list(self._label_ids(label))
        return head + [self._word(seed, i) for i in range(n_words)] + [self.eos]

    def token_at(self, label: str, prompt_ids: list[int] | tuple[int, ...], i: int) -> int:
        """Token ``i`` of an answer that never stops (``ignore_eos``): the answer without
        its EOS, then more words."""
        head = self.answer(label, prompt_ids)[:-1]
        return head[i] if i < len(head) else self._word(self._seed(label, prompt_ids), i)

    def _word(self, seed: int, i: int) -> int:
        h = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest()
        return self.words[int.from_bytes(h, "big") % len(self.words)]

    @staticmethod
    def _seed(label: str, prompt_ids: list[int] | tuple[int, ...]) -> int:
        h = hashlib.blake2b(label.encode(), digest_size=8)
        h.update(b"\0" + ",".join(map(str, prompt_ids)).encode())
        return int.from_bytes(h.digest(), "big")
