"""The fleet simulator of ``bench.py --sim``: the mesh's own routing and admission code on a
fleet of simulated engines, on a virtual clock.

- :mod:`bench.fleet.fleet`: the fleet, its replicas and requests;
- :mod:`bench.fleet.routers`: Serve's routers and the mesh's, as the fleet runs them;
- :mod:`bench.fleet.workloads`: seeded workloads (many adapters, sessions, tenants, closed loops);
- :mod:`bench.fleet.virtual_time`: the virtual clock;
- :mod:`bench.fleet.runs`: one run on a fresh fleet and its figures.
"""
