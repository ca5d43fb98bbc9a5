"""Stage 4 of a request, admit: each variant's slots and queue (``variant_queue``), its
order among tenants and priorities (``fair_queue``, ``fair_share``), the wait it estimates
and the late requests it sheds (``shedding``), and the 503 with ``Retry-After`` for what
cannot start in time (``refusals``)."""
