"""available_memory_bytes: /proc/meminfo and cgroup v1 / v2 limits, read from real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapref_ray.models.device_memory import (
    available_memory_bytes,
    cgroup_available_bytes,
    meminfo_available_bytes,
)

MEMINFO = "MemTotal:       24684084 kB\nMemFree:        21248800 kB\nMemAvailable:   22746916 kB\nBuffers: 1 kB\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_meminfo_available_is_read_in_bytes(tmp_path):
    assert meminfo_available_bytes(write(tmp_path / "meminfo", MEMINFO)) == 22746916 * 1024
    with pytest.raises(ValueError, match="no MemAvailable line"):
        meminfo_available_bytes(write(tmp_path / "old", "MemTotal: 1 kB\nMemFree: 1 kB\n"))


def test_this_machine_reports_a_positive_figure_within_its_memory():
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 < available_memory_bytes("cpu") <= total
    with pytest.raises(ValueError, match="no memory query for device type 'meta'"):
        available_memory_bytes("meta")


def test_cgroup_v2_limit_minus_usage_counts_page_cache_as_free(tmp_path):
    root = tmp_path / "cgroup"
    group = root / "job" / "worker"
    write(group / "memory.max", "8589934592\n")  # 8 GiB
    write(group / "memory.current", str(3 * 2**30))
    write(group / "memory.stat", f"anon {2 * 2**30}\nfile {2**30}\ninactive_file {2**29}\nactive_file 1\n")
    proc = write(tmp_path / "proc_cgroup", "0::/job/worker\n")
    assert cgroup_available_bytes(proc, root) == 8 * 2**30 - (3 * 2**30 - 2**29)


def test_cgroup_v2_without_a_limit_is_none(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory.max", "max\n")
    write(root / "memory.current", "123\n")
    assert cgroup_available_bytes(write(tmp_path / "proc_cgroup", "0::/\n"), root) is None


def test_cgroup_v1_memory_controller_in_a_container(tmp_path):
    # The listed path is the host's; inside the container the mount shows only our group.
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", str(4 * 2**30))
    write(root / "memory" / "memory.usage_in_bytes", str(2**30))
    write(root / "memory" / "memory.stat", f"cache 5\ntotal_inactive_file {2**28}\n")
    proc = write(tmp_path / "proc_cgroup", "4:memory:/docker/abc\n3:cpu:/docker/abc\n0::/\n")
    assert cgroup_available_bytes(proc, root) == 4 * 2**30 - (2**30 - 2**28)
    # "No limit" in v1 is a huge page-rounded number.
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_available_bytes(proc, root) is None


def test_no_cgroup_information_is_none(tmp_path):
    assert cgroup_available_bytes(tmp_path / "missing", tmp_path) is None
    assert cgroup_available_bytes(write(tmp_path / "proc_cgroup", "0::/x\n"), tmp_path / "nothing") is None
