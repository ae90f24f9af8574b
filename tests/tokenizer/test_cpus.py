"""The tokenizer threads' default: the CPUs the container may use, read from fake cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tokenizer.cpus import available_cpus, cgroup_cpu_quota


def write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v2_quota_is_rounded_up(tmp_path) -> None:
    write(tmp_path, "cpu.max", "150000 100000")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert available_cpus(tmp_path, affinity=8) == 2


def test_cgroup_v2_max_is_no_limit(tmp_path) -> None:
    write(tmp_path, "cpu.max", "max 100000")
    assert cgroup_cpu_quota(tmp_path) is None
    assert available_cpus(tmp_path, affinity=8) == 8


@pytest.mark.parametrize("directory", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path, directory) -> None:
    write(tmp_path, f"{directory}/cpu.cfs_quota_us", "300000")
    write(tmp_path, f"{directory}/cpu.cfs_period_us", "100000")
    assert available_cpus(tmp_path, affinity=16) == 3


def test_cgroup_v1_minus_one_is_no_limit(tmp_path) -> None:
    write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert available_cpus(tmp_path, affinity=4) == 4


def test_v2_wins_over_v1_on_a_hybrid_host(tmp_path) -> None:
    write(tmp_path, "cpu.max", "200000 100000")
    write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert available_cpus(tmp_path, affinity=8) == 2


def test_affinity_smaller_than_quota_wins(tmp_path) -> None:
    write(tmp_path, "cpu.max", "800000 100000")
    assert available_cpus(tmp_path, affinity=3) == 3


def test_missing_or_garbled_files_leave_the_affinity(tmp_path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None
    assert available_cpus(tmp_path, affinity=5) == 5
    write(tmp_path, "cpu/cpu.cfs_quota_us", "100000")  # the period missing: no quota
    assert available_cpus(tmp_path, affinity=5) == 5
    write(tmp_path, "cpu.max", "garbage")
    assert available_cpus(tmp_path, affinity=5) == 5


def test_a_tiny_quota_is_still_one_cpu(tmp_path) -> None:
    write(tmp_path, "cpu.max", "1000 100000")
    assert available_cpus(tmp_path, affinity=4) == 1


def test_this_machine_gives_at_least_one() -> None:
    assert available_cpus() >= 1
