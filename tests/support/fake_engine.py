"""A replica's serving logic (the real :class:`ReplicaServer` and adapter set) on a fake engine
and a fake vLLM LoRA loader: unit tests of the replica side without Ray or vLLM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from serve_app.common.paths import DEFAULT_MODEL_NAME
from serve_app.server.lora import AdapterSet
from serve_app.server.serving import ReplicaServer


class FakeEngine:
    """A :class:`ServingEngine` that answers what a test gives it and records the bodies."""

    max_num_seqs = 4
    max_model_len = 2048

    def __init__(self, answer=None, *, raises: BaseException | None = None,
                 priority_scheduling: bool = True) -> None:
        self.answer, self.raises = answer, raises
        self.priority_scheduling = priority_scheduling
        self.errored = False
        self.bodies: list[tuple[str, dict]] = []

    async def run(self, endpoint, body):
        self.bodies.append((endpoint, body))
        if self.raises is not None:
            raise self.raises
        return self.answer() if callable(self.answer) else self.answer

    def num_unfinished(self) -> int:
        return 0


class FakeLoRAModels:
    """vLLM's ``OpenAIServingModels`` as :class:`AdapterSet` uses it; counts the loads, takes
    ``load_s`` per load, and refuses the names in ``broken`` as vLLM would (ErrorResponse)."""

    def __init__(self, load_s: float = 0.0, broken: tuple[str, ...] = ()) -> None:
        self.lora_requests: dict[str, SimpleNamespace] = {}
        self.loads: list[str] = []
        self.load_s, self.broken = load_s, broken
        self._ids = 0

    async def load_lora_adapter(self, request):
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
        await asyncio.sleep(self.load_s)
        if request.lora_name in self.broken:
            return ErrorResponse(error=ErrorInfo(message="bad tensor shapes", type="x",
                                                 code=400))
        self._ids += 1
        self.loads.append(request.lora_name)
        self.lora_requests[request.lora_name] = SimpleNamespace(lora_int_id=self._ids)

    async def unload_lora_adapter(self, request):
        self.lora_requests.pop(request.lora_name)


def replica_server(engine: FakeEngine, user_config: dict | None = None) -> ReplicaServer:
    """Replica ``r1`` of smollm-v1 on ``engine``, reconfigured with ``user_config`` (no stream
    batching by default), over the real adapter set and a fake LoRA loader."""
    adapters = AdapterSet(FakeLoRAModels(), SimpleNamespace(remove_lora=noop),
                          base_model=DEFAULT_MODEL_NAME, max_lora_rank=16)
    s = ReplicaServer("smollm-v1", engine, adapters, replica="r1")
    asyncio.run(s.reconfigure(user_config or {"stream_batching_interval_ms": 0}))
    return s


async def noop(*_):
    """Takes anything, does nothing (vLLM's ``remove_lora`` here)."""
    return None
