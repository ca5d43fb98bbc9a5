"""Benchmarks, drills, load generation and the fleet simulator: what ``scripts/`` and ``tests/``
run against the mesh. Not part of the product, and not in its wheel (``pyproject.toml``
packages ``serve_app`` only); importable with the repository's root on ``sys.path``, as the
scripts put it and as pytest's ``pythonpath`` does.

- :mod:`bench.cli`: ``scripts/bench.py``'s command line, one mode per benchmark module:
  :mod:`bench.mesh_vs_vllm` (the default), :mod:`bench.limits`, :mod:`bench.sessions`,
  :mod:`bench.adapters`, :mod:`bench.router_throughput`, :mod:`bench.scale` (``--sim``, with
  :mod:`bench.trust`, :mod:`bench.router_cost` and :mod:`bench.scale_plots`);
- their parts: :mod:`bench.loadgen` (the load), :mod:`bench.measure`, :mod:`bench.host_cpu`,
  :mod:`bench.direct_vllm` (vLLM's own server as the baseline), :mod:`bench.servers`,
  :mod:`bench.adapter_copies`, :mod:`bench.tokenizer`;
- :mod:`bench.drills` (overload drills), :mod:`bench.calibration` (fitting a simulated-engine
  profile from a real engine), :mod:`bench.fleet` (the fleet simulator);
- ``bench/data/``: past runs the code replays (``trust_runs.yaml``).
"""
