"""Stages 5 and 6 of a request, call and relay: the variant's replica through its handle,
failover before the first byte (``dispatcher``), the stream to the client (``relay``), and
the request's account, which settles its slots however it ends (``account``)."""
