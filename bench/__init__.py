"""What ``scripts/`` and ``tests/`` run beside the mesh: benchmarks, drills, load generation,
the fleet simulator, the servers they start, the demo's full stop, and the scripts' command
line. Not part of the product, and not in its wheel (``pyproject.toml`` packages
``serve_app`` only); importable with the repository's root on ``sys.path``: the scripts of
``scripts/`` put it there (their one ``sys.path.insert``), ``python -m bench.<module>`` from
the root has it (``scripts/stop.sh``, ``scripts/observability.sh``), and so does pytest's
``pythonpath``.

- :mod:`bench.cli`: ``scripts/bench.py``'s command line, one mode per benchmark module:
  :mod:`bench.mesh_vs_vllm` (the default), :mod:`bench.limits`, :mod:`bench.sessions`,
  :mod:`bench.adapters`, :mod:`bench.router_throughput`, :mod:`bench.scale` (``--sim``, with
  :mod:`bench.trust`, :mod:`bench.router_cost` and :mod:`bench.scale_plots`);
- their parts: :mod:`bench.loadgen` (the load), :mod:`bench.measure`, :mod:`bench.host_cpu`,
  :mod:`bench.direct_vllm` (vLLM's own server as the baseline), :mod:`bench.servers`,
  :mod:`bench.adapter_copies`, :mod:`bench.tokenizer`;
- :mod:`bench.drills` (overload drills), :mod:`bench.calibration` (fitting a simulated-engine
  profile from a real engine), :mod:`bench.fleet` (the fleet simulator);
- :mod:`bench.script_args` (every script's ``--help`` with defaults and one-line errors),
  :mod:`bench.local_prometheus` (``scripts/observability.sh``), :mod:`bench.full_stop`
  (``scripts/stop.sh``);
- ``bench/data/``: past runs the code replays (``trust_runs.yaml``).
"""
