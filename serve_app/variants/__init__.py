"""The variants a router sends to (``registry.VariantRegistry``): whether each runs and
what it serves (``availability``), cold starts from zero replicas (``cold_start``), and the
resident budget (``resident_budget``)."""
