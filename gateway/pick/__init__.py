"""Replica pickers and scorers: which replica with room takes a request.

Importing this package registers every picker and scorer it holds (`config/plugins.py`), so a
policy's names resolve whichever of its modules were imported first: a new scorer's module is
listed here and nowhere else. One module a job: `picker.py` the policy-wide pickers (the
`picker` extension point is admission's, gateway/admit/picking.py); `scorers.py` the `scorer`
extension point and the scorers that need no feed; `precise.py` the scorer fed by the replicas'
KV-cache events; `weighted.py` the picker a pool's `pick:` makes of its scorers; `prompt.py` the
prompt as a replica's cache sees it, hashed into the `Affinity` (gateway/context/affinity.py) a
request carries for them to weigh.

Pickers implement admission's interface and import its types; admission imports no picker.
"""

from gateway.pick import precise  # noqa: F401  # registers `precise_prefix`
from gateway.pick.picker import LeastInflightPicker, RoundRobinPicker
from gateway.pick.scorers import Scorer
from gateway.pick.weighted import WeightedPicker

__all__ = ["LeastInflightPicker", "RoundRobinPicker", "Scorer", "WeightedPicker"]
