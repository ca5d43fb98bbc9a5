"""A task many requests share survives the request that started it (serve_app.common.shared_task),
on real Ray: Ray cancels a cancelled actor task's child calls, and a task created while a
request runs is that request's child (CI lost the tenant ledger's settlements this way)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from serve_app.tenancy.call_batcher import CallBatcher

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class Recorder:
    """Stands for the tenant ledger: a call that takes a while, and what it has recorded."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.recorded: list[str] = []

    async def record(self, items: list[str]) -> list[None]:
        self.started += items
        await asyncio.sleep(0.5)
        self.recorded += items
        return [None] * len(items)

    def seen(self) -> tuple[list[str], list[str]]:
        return self.started, self.recorded


@ray.remote(num_cpus=0)
class Requester:
    """Stands for a router replica: a request that starts a call, then waits for its client."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder
        self.batcher = CallBatcher(lambda items: self.recorder.record.remote(items))

    async def request(self, item: str, shared: bool) -> None:
        if shared:
            self.batcher.submit(item)  # the batcher sends its call from start_shared_task
        else:  # as the batcher did before
            asyncio.get_running_loop().create_task(self._call(item))
        await asyncio.sleep(60)  # the client leaves before this ends

    async def _call(self, item: str) -> None:
        await self.recorder.record.remote([item])

    def ready(self) -> bool:
        return True


def recorded_after_cancel(requester, recorder, item: str, shared: bool) -> list[str]:
    """Whether ``item``'s call, running in the recorder when its request is cancelled,
    completes."""
    ref = requester.request.remote(item, shared)
    deadline = time.monotonic() + 30
    while item not in ray.get(recorder.seen.remote())[0]:  # until the call runs
        assert time.monotonic() < deadline, "the request's call did not start"
        time.sleep(0.05)
    ray.cancel(ref)  # recursive, as Serve cancels a request whose client left
    settled = time.monotonic() + 5  # a call that survives is recorded 0.5 s after it began
    while item not in (recorded := ray.get(recorder.seen.remote())[1]) \
            and time.monotonic() < settled:
        time.sleep(0.1)
    return recorded


def test_a_shared_tasks_ray_calls_outlive_the_cancelled_request_that_started_it(mesh):
    recorder = Recorder.remote()
    requester = Requester.remote(recorder)
    ray.get(requester.ready.remote())
    # The mechanism: a call made by the request's own task dies with it.
    assert recorded_after_cancel(requester, recorder, "child", shared=False) == []
    # CallBatcher's call goes out in a shared task: it is recorded.
    assert recorded_after_cancel(requester, recorder, "shared", shared=True) == ["shared"]
