"""Variants that just lost a replica, as the router's calls and polls find it
(:mod:`serve_app.variants.availability` keeps one :class:`ReplicaLoss`).

Calls to a replica on a lost node hang until Ray declares its actors dead, and the Serve
status shows the variant without that replica only then. Meanwhile a variant is marked lost
when a call ends with Ray's "actor died" or "actor unavailable", or when
:data:`MISSED_POLLS_LOST` of its ``serving_info`` polls in a row go unanswered; a lost variant
is tried after the route's others for :data:`LOST_REPLICA_S`, or until a replica other than
the one last seen answers a poll.
"""

from __future__ import annotations

import time

from serve_app.common.failures import queue_full, replica_gone
from serve_app.common.logs import get_logger

logger = get_logger(__name__)

#: Seconds a variant that just lost a replica (a call ended with Ray's "actor died" or "actor
#: unavailable") is tried only after the others. Calls to a replica on a lost node hang until
#: Ray declares its actors dead (its node health checks take 15 s or more); by then the
#: Serve status shows the variant without that replica.
LOST_REPLICA_S = 30.0
#: Polls in a row that a RUNNING variant must miss (no answer to ``serving_info`` within two
#: periods; a poll Serve's handle refused because the replica's queue is full is no miss)
#: before it counts as having lost its replica. Serve's handle then cannot place
#: even this small call, so a request would wait just as long. The router's admission keeps
#: a replica's requests far below ``max_ongoing_requests``, so load alone does not queue it.
MISSED_POLLS_LOST = 3


class ReplicaLoss:
    """Lost marks and missed polls, per application name (times on ``time.monotonic``, s).

    Attributes:
        missed: application -> ``serving_info`` polls missed in a row.
    """

    def __init__(self) -> None:
        self.missed: dict[str, int] = {}
        self._lost_until: dict[str, float] = {}  # app -> monotonic time the mark ends
        self._lost_replica: dict[str, str] = {}  # app -> the replica last seen when lost

    def is_lost(self, application: str) -> bool:
        """``application`` is marked lost now (:meth:`lost`)."""
        return self._lost_until.get(application, 0.0) > time.monotonic()

    def lost(self, application: str, last_replica: str) -> None:
        """A call to ``application`` found its replica gone: mark it lost for
        :data:`LOST_REPLICA_S` (from now), or until a replica other than ``last_replica``
        (the one whose answer the view holds; "" if none) answers (:meth:`answered`)."""
        if self._lost_until.get(application, 0.0) <= time.monotonic():
            logger.warning("variant %s lost a replica; trying the route's other variants "
                           "first for %.0f s, or until another replica answers", application,
                           LOST_REPLICA_S)
            self._lost_replica[application] = last_replica
        self._lost_until[application] = time.monotonic() + LOST_REPLICA_S

    def missed_poll(self, application: str, error: BaseException) -> bool:
        """A poll of ``application`` ended in ``error``; True when it now counts as lost
        (:data:`MISSED_POLLS_LOST` in a row, or its replica gone; the caller then marks it:
        :meth:`lost`). A poll refused because the handle's queue is full is no miss."""
        if queue_full(error):  # refused before it reached a replica: not a miss
            return False
        self.missed[application] = self.missed.get(application, 0) + 1
        return self.missed[application] >= MISSED_POLLS_LOST or replica_gone(error)

    def answered(self, application: str, replica: str) -> None:
        """``replica`` of ``application`` answered a poll: no miss in a row, and the lost
        mark ends if the replica is another than the one lost."""
        self.missed[application] = 0
        if self.is_lost(application) and replica != self._lost_replica.get(application):
            # Another replica answers (Serve replaced the one lost, or the variant runs
            # more): a call placed now reaches it, so the variant need not wait out the mark.
            logger.info("variant %s: replica %s answers; available again", application,
                        replica or "?")
            self._lost_until.pop(application)

    def known(self) -> set[str]:
        """Applications with a lost mark or a count of missed polls."""
        return {*self._lost_until, *self.missed}

    def forget(self, application: str) -> None:
        """``application`` was deleted: its marks say nothing of one deployed again under
        its name."""
        for known in (self._lost_until, self._lost_replica, self.missed):
            known.pop(application, None)
