"""The load generator: the article's load test, its report, knee finder, profile and compare.

In-process use (what `llm-loadtest sweep | profile | compare` do):

    result = await run_sweep(SweepConfig(targets=(Target(url, "gemma-3-27b-it", tok_dir),),
                                         workloads=(load_workload("generation"),)))
    write_report(result, "out/")                       # JSON, CSV, Markdown, PNG
    knee = find_knee(result.curves()[0].points())      # and policy_snippet(knee, ...)

    outcome = await run_compare(CompareConfig(targets=(("round-robin", rr), ("gateway", gw)),
                                              rate=12, duration_s=60))
    write_compare_report(outcome, "out/")

    workload = build_profile(read_access_log("access.jsonl")).to_workload("production")
"""

from loadtest.loadgen.compare import (
    DEFAULT_SLOS,
    SLO,
    CompareConfig,
    CompareResult,
    run_compare,
    write_compare_report,
)
from loadtest.loadgen.knee import Knee, KneeParams, find_knee, policy_snippet
from loadtest.loadgen.profile import Profile, build_profile, read_access_log
from loadtest.loadgen.prompts import PromptBuilder
from loadtest.loadgen.report import Mark, analyse, write_report
from loadtest.loadgen.roundrobin import create_roundrobin_app, roundrobin_process
from loadtest.loadgen.runner import RequestRecord
from loadtest.loadgen.stats import LevelStats, Point, jump_flags, normalise, percentile, summarize
from loadtest.loadgen.sweep import SweepConfig, SweepResult, Target, run_sweep
from loadtest.loadgen.workloads import (
    BUILTIN,
    Workload,
    WorkloadClass,
    dump_workload,
    load_workload,
)

__all__ = [
    "BUILTIN",
    "DEFAULT_SLOS",
    "SLO",
    "CompareConfig",
    "CompareResult",
    "Knee",
    "KneeParams",
    "LevelStats",
    "Mark",
    "Point",
    "Profile",
    "PromptBuilder",
    "RequestRecord",
    "SweepConfig",
    "SweepResult",
    "Target",
    "Workload",
    "WorkloadClass",
    "analyse",
    "build_profile",
    "create_roundrobin_app",
    "dump_workload",
    "find_knee",
    "jump_flags",
    "load_workload",
    "normalise",
    "percentile",
    "policy_snippet",
    "read_access_log",
    "roundrobin_process",
    "run_compare",
    "run_sweep",
    "summarize",
    "write_compare_report",
    "write_report",
]
