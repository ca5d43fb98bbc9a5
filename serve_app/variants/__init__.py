"""The variants a router sends to (``registry.VariantRegistry``): whether each runs and
what it serves (``availability``, over what Serve's controller says, ``serve_view``, the
states of variants that scale to zero, ``lifecycle``, and lost replicas, ``replica_loss``),
cold starts from zero replicas (``cold_start``), and the resident budget
(``resident_budget``)."""
