"""The simulated engine: vLLM's own front end (``AsyncLLM``, the OpenAI serving layer, its
metrics) on an engine core whose time follows a cost model, for tests and scale benchmarks.

A variant chooses it in its ``args`` (``engine: sim``, ``sim: {profile: ...}``); no shipped
config does, and ``meshctl validate`` flags one that does. Modules:

- ``profiles/*.yaml``: the cost models (read by :mod:`~serve_app.common.sim_profile`);
- :mod:`~serve_app.sim.scheduler`: continuous batching under vLLM's limits (pure);
- :mod:`~serve_app.sim.prefix_cache`: the block prefix cache (LRU);
- :mod:`~serve_app.sim.answers`: deterministic answers keyed by adapter, model and prompt;
- :mod:`~serve_app.sim.core`: the engine core in place of vLLM's, and the ``AsyncLLM`` on it.
- :mod:`~serve_app.sim.engine`: :class:`~serve_app.sim.engine.SimEngine`, the replica's
  :class:`~serve_app.server.engine_protocol.Engine` for ``engine: sim``, and its drills.
"""
