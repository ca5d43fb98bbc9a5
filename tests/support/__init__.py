"""Helpers the unit and integration tests share (no tests here): waits, metric reads, fakes,
catalogs, the integration mesh and the demo configs' keys and rollouts. Import them as
``from tests.support.<module> import ...``; no test module imports another."""
