"""Which replica of a variant takes a request: ``router.AffinityRouter``, a Serve
``RequestRouter`` that runs inside the handle, over the pure rules of ``affinity``."""
