"""The engine seam: ``args.engine`` chooses the replica's engine class by injection
(:func:`engine_cls_for`), the production engine carries no drills of its own, and the
replica reaches drills only through :func:`run_drill` (no vLLM engine starts here)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest

from serve_app.common.config import VariantArgs
from serve_app.server.drills import VllmDrills, run_drill
from serve_app.server.engine import ENGINE_CLASSES, engine_cls_for
from serve_app.server.engine_protocol import Engine

VLLM = {"model": "smollm2-135m-instruct", "served_model_name": "smollm"}
SIM = {**VLLM, "engine": "sim", "sim": {"profile": "cpu-smollm2", "reconfigure_s": 0.5}}
#: Names a drill hook has had on the replica or the engine.
DRILL_NAMES = ("kill", "kill_engine", "die", "drill", "before_reconfigure", "reconfigure_s",
               "fail_start")


def test_args_engine_chooses_the_engine_class():
    from serve_app.server.vllm_engine import VllmEngine
    from serve_app.sim.engine import SimEngine

    assert engine_cls_for(VariantArgs.model_validate(VLLM)) is VllmEngine
    assert engine_cls_for(VariantArgs.model_validate(SIM)) is SimEngine
    assert issubclass(VllmEngine, Engine) and issubclass(SimEngine, Engine)
    assert not issubclass(SimEngine, VllmEngine)  # siblings: no sim branch in vLLM's class
    assert sorted(ENGINE_CLASSES) == ["sim", "vllm"]


def test_an_engine_with_no_class_is_refused_by_name():
    with pytest.raises(ValueError, match=r"args.engine 'tgi' has no engine class: use one "
                                         r"of sim, vllm"):
        engine_cls_for(SimpleNamespace(engine="tgi"))


def test_a_vllm_replica_imports_no_simulated_engine():
    """The class is imported from its path only when chosen."""
    code = ("import sys; from serve_app.common.config import VariantArgs; "
            "from serve_app.server.engine import engine_cls_for; "
            f"engine_cls_for(VariantArgs.model_validate({VLLM!r})); "
            "print(sorted(m for m in sys.modules if m.startswith('serve_app.sim')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_production_engine_has_no_drill_methods():
    from serve_app.server.vllm_engine import VllmEngine, VllmFrontEnd

    for cls in (VllmEngine, VllmFrontEnd):
        assert [n for n in DRILL_NAMES if hasattr(cls, n)] == [], cls
    engine = VllmEngine(VariantArgs.model_validate(VLLM))
    assert type(engine.drills) is VllmDrills and engine.drills.names == {"kill_engine"}


def test_the_simulated_engine_carries_its_drills_from_args_sim():
    from serve_app.sim.engine import SimDrills, SimEngine

    engine = SimEngine(VariantArgs.model_validate(SIM))
    assert type(engine.drills) is SimDrills and engine.drills.reconfigure_s == 0.5
    assert SimEngine(VariantArgs.model_validate({**SIM, "sim": None})).drills.reconfigure_s == 0


class Core:
    """A simulated core as the sim's drills see it: it records its death."""

    def __init__(self) -> None:
        self.died = 0

    def die(self) -> None:
        self.died += 1


def started_sim(reconfigure_s: float = 0.0):
    """A :class:`SimEngine` whose ``engine_client`` is a stand-in holding a :class:`Core`."""
    from serve_app.sim.engine import SimEngine

    engine = SimEngine(VariantArgs.model_validate(
        {**SIM, "sim": {"profile": "cpu-smollm2", "reconfigure_s": reconfigure_s}}))
    engine.engine_client = SimpleNamespace(engine_core=Core(), shutdown=lambda: None)
    return engine


def test_run_drill_runs_a_named_drill_and_refuses_others():
    engine = started_sim()
    asyncio.run(run_drill(engine, "kill_engine"))
    assert engine.engine_client.engine_core.died == 1
    with pytest.raises(ValueError, match=r"unknown drill 'stall' for SimEngine: use one of "
                                         r"kill_engine"):
        asyncio.run(run_drill(engine, "stall"))
    with pytest.raises(ValueError, match="unknown drill 'before_reconfigure'"):
        asyncio.run(run_drill(engine, "before_reconfigure"))  # a hook, not a named drill
    with pytest.raises(TypeError, match="unexpected keyword argument 'after_s'"):
        asyncio.run(run_drill(engine, "kill_engine", after_s=1))
    assert engine.engine_client.engine_core.died == 1


def test_an_engine_without_drills_refuses_every_drill():
    class Plain:
        drills = None

    with pytest.raises(ValueError, match=r"drill 'kill_engine': this replica's engine \(Plain\) "
                                         r"has no drills"):
        asyncio.run(run_drill(Plain(), "kill_engine"))


def replica_on(engine) -> tuple:
    """An ``LLMReplica`` shell on ``engine`` and a server that records its reconfigures (no
    Serve: the attributes ``__init__`` would set)."""
    from serve_app.replica import LLMReplica

    configs = []

    async def reconfigure(user_config):
        configs.append(user_config)
    replica = object.__new__(LLMReplica)
    replica.engine = engine
    replica.server = SimpleNamespace(variant="smollm-v1", reconfigure=reconfigure)
    return replica, configs


def test_the_replica_kills_its_engine_through_the_engines_drills():
    engine = started_sim()
    replica, _ = replica_on(engine)
    asyncio.run(replica.kill_engine())
    asyncio.run(replica.drill("kill_engine"))
    assert engine.engine_client.engine_core.died == 2


def test_the_replica_waits_the_sim_reconfigure_drill_and_nothing_on_vllm(monkeypatch):
    from serve_app.server.vllm_engine import VllmEngine

    slept = []

    async def sleep(s):
        slept.append(s)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    replica, configs = replica_on(started_sim(reconfigure_s=0.5))
    asyncio.run(replica.reconfigure({"system_prompt": "A."}))
    assert slept == [0.5] and configs == [{"system_prompt": "A."}]
    slept.clear()
    replica, configs = replica_on(VllmEngine(VariantArgs.model_validate(VLLM)))
    asyncio.run(replica.reconfigure({}))
    replica, _ = replica_on(SimpleNamespace(drills=None, shutdown=lambda: None))
    asyncio.run(replica.reconfigure({}))
    assert slept == []
