"""Integration tests: one real Ray cluster with Serve per session (conftest.py), variants on the
simulated engine unless MESH_TEST_ENGINE=vllm; every test here is marked ``integration``."""
