"""The pick stage: which replica with room takes a request.

Importing this package registers every picker and scorer it holds (`policy/plugins.py`), so a
policy's names resolve whichever of its modules were imported first: a new scorer's module is
listed here and nowhere else. One module a job: `picker.py` the `picker` extension point and the
policy-wide pickers; `scorers.py` the `scorer` extension point and the scorers that need no
feed; `precise.py` the scorer fed by the replicas' KV-cache events; `weighted.py` the picker a
pool's `pick:` makes of its scorers; `affinity.py` what a request carries for them to weigh.

No module here imports the admit stage at run time: the admit stage imports this one (its
claims carry an `Affinity`), and a picker only needs its types to be annotated.
"""

from gateway.pick import precise  # noqa: F401  # registers `precise_prefix`
from gateway.pick.picker import LeastInflightPicker, RoundRobinPicker
from gateway.pick.scorers import Scorer
from gateway.pick.weighted import WeightedPicker

__all__ = ["LeastInflightPicker", "RoundRobinPicker", "Scorer", "WeightedPicker"]
