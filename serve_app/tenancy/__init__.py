"""Tenancy: who calls (API keys, ``keys``), what a request reserves and is charged (token
budgets, ``token_budget``), and the limits that hold across every router (``limits``,
counted in a ``ledger``: a Ray actor or Redis). Stages 1 and 3 of a request: authenticate,
then take the tenant's slot and reserve its tokens; the request's
:class:`~serve_app.dispatch.account.RequestAccount` settles them when it ends.
"""
