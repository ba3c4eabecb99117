"""Unit tests: the CPUs a worker sizes its thread pool by, from the affinity mask and the
cgroup's CPU quota (v2 ``cpu.max``, v1 ``cfs_quota_us``), on fake cgroup folders."""

from __future__ import annotations

import os

import pytest

from triode.engine.cpus import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def _v2(tmp_path, text: str):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def _v1(tmp_path, quota: int, period: int):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_no_cgroup_means_the_affinity_mask(tmp_path):
    assert usable_cpus(tmp_path) == AFFINITY


@pytest.mark.parametrize(("text", "expected"), [
    ("max 100000\n", AFFINITY),  # no quota
    ("100000 100000\n", 1),
    ("150000 100000\n", min(2, AFFINITY)),  # 1.5 CPUs: two threads, each busy part of the time
    ("5000 100000\n", 1),  # never zero
    ("400000000 100000\n", AFFINITY),  # a quota above the mask: the mask
])
def test_a_v2_quota_caps_the_count(tmp_path, text, expected):
    assert usable_cpus(_v2(tmp_path, text)) == expected


@pytest.mark.parametrize(("quota", "period", "expected"), [(-1, 100000, AFFINITY), (100000, 100000, 1)])
def test_a_v1_quota_caps_the_count(tmp_path, quota, period, expected):
    assert usable_cpus(_v1(tmp_path, quota, period)) == expected


def test_an_unreadable_quota_is_no_limit(tmp_path):
    assert usable_cpus(_v2(tmp_path, "garbage")) == AFFINITY
