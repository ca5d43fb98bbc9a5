"""What an answer shows of who gave it, on either engine (:attr:`tests.support.mesh.Mesh.engine`).

On real vLLM, an adapter is told by the behaviour it was trained for (a signature phrase); on
the simulated engine, an adapter's answer starts with ``<name@vN>:``, the adapter version that
gave it, and a model's answer is words (:mod:`serve_app.sim.answers`).
"""

from __future__ import annotations

import re

#: The demo adapters' trained openings (scripts/train_adapter.py), on real vLLM.
PHRASES = {"acme-support@v1": "Acme Support here!",
           "acme-support@v2": "Acme Support v2 at your service!",
           "globex-report@v1": "GLOBEX ANSWER:"}

_SIM_ADAPTER = re.compile(r"^[A-Za-z0-9._-]+@v\d+:")


def signature(engine: str, who: str) -> str:
    """The opening of an answer by ``who`` (an adapter version ``name@vN``) on ``engine``."""
    return f"{who}:" if engine == "sim" else PHRASES[who]


def is_base_answer(engine: str, text: str) -> bool:
    """``text`` came from the base model, not from a demo adapter."""
    if engine == "sim":
        return not _SIM_ADAPTER.match(text)
    return not text.startswith(tuple(PHRASES.values()))
