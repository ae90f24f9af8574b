"""The admit stage: hold a slot on one replica while the request runs, or wait for one, or refuse.

One module a job: `claim.py` what a request weighs; `replica.py` a replica's caps, counts and
health state; `fairqueue.py` the queue (tiers, fair share, reservation groups); `demand.py` hold
times and demand; `ejection.py` outlier ejection; `limiter.py` adaptive caps; `leases.py` the
shared ledger's side; `pool.py`
`LivePool`, which composes them and is what the pipeline, the health checker and the metrics
hold. Which replica with room takes a request is the pick stage's (`gateway.pick`): the pool
asks its picker, and this package exports none, so a picker has one home.
"""

from gateway.admit.claim import Claim
from gateway.admit.demand import Demand, HoldTimes
from gateway.admit.fairqueue import Place
from gateway.admit.leases import POLL_S
from gateway.admit.pool import LivePool
from gateway.admit.replica import Grant, Replica

__all__ = [
    "POLL_S",
    "Claim",
    "Demand",
    "Grant",
    "HoldTimes",
    "LivePool",
    "Place",
    "Replica",
]
