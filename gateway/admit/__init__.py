"""The admit stage: hold a slot on one replica while the request runs, or wait for one, or refuse.

One module a job: `claim.py` what a request weighs; `replica.py` a replica's caps, counts and
health state; `picker.py` the `picker` extension point; `fairqueue.py` the queue (tiers, fair
share, reservation groups); `drain.py` hold times and demand; `ejection.py` outlier ejection;
`leases.py` the shared ledger's side; `slots.py` `LivePool`, which composes them and is what
the pipeline, the health checker and the metrics hold.
"""

from gateway.admit.claim import Claim
from gateway.admit.demand import Demand, HoldTimes
from gateway.admit.fairqueue import Place
from gateway.admit.leases import POLL_S
from gateway.admit.pool import LivePool
from gateway.admit.replica import Grant, Replica
from gateway.pick.picker import LeastInflightPicker, Picker

__all__ = [
    "POLL_S",
    "Claim",
    "Demand",
    "Grant",
    "HoldTimes",
    "LeastInflightPicker",
    "LivePool",
    "Picker",
    "Place",
    "Replica",
]
