"""A simulated vLLM replica: vLLM's OpenAI HTTP surface and metrics over a modelled engine.

    from loadtest.sim import load_profile, ReplicaOptions, start_replica
    replica = await start_replica(load_profile("gemma-3-27b-tpu-v6e-2x2"),
                                  ReplicaOptions(time_scale=50))
    ...  # point clients at replica.url
    await replica.close()

`create_replica_app` gives the bare aiohttp app for a runner of your own; `llm-loadtest
simulate` serves several replicas from one process. How the engine is modelled, and where every
number comes from: docs/simulator.md.
"""

from loadtest.sim.engine import Engine, Scheduler
from loadtest.sim.faults import Faults
from loadtest.sim.profiles import (
    CacheGeometry,
    Profile,
    bundled_profiles,
    cache_geometry,
    load_profile,
)
from loadtest.sim.roofline import BatchShape, Roofline
from loadtest.sim.sequence import Sequence, Status
from loadtest.sim.server import (
    REPLICA,
    Replica,
    ReplicaOptions,
    ReplicaState,
    create_replica_app,
    start_replica,
)

__all__ = [
    "REPLICA",
    "BatchShape",
    "CacheGeometry",
    "Engine",
    "Faults",
    "Profile",
    "Replica",
    "ReplicaOptions",
    "ReplicaState",
    "Roofline",
    "Scheduler",
    "Sequence",
    "Status",
    "bundled_profiles",
    "cache_geometry",
    "create_replica_app",
    "load_profile",
    "start_replica",
]
