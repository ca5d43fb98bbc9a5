"""Tenancy: who calls (API keys), what a request reserves and is charged (token budgets),
the limits that hold across every router (a ledger of counts), and the per-request
accounting that settles them however a request ends.

A request passes through :class:`~serve_app.tenancy.accounting.RequestAccount`: it
holds the tenant slot (:class:`~serve_app.tenancy.limits.TenantLimiter`, counted in the
cluster's ledger) before admission and settles it with the tokens the request cost
when it ends.
"""
