"""How many bytes a new allocation on a device can still get, without psutil.

CUDA: the driver's free memory (`torch.cuda.mem_get_info`) plus what PyTorch's caching allocator
has reserved but holds unused (it hands that out again before asking the driver).

CPU: `MemAvailable` of /proc/meminfo (free memory plus the page cache the kernel can drop), capped
by what the process's cgroup still allows (v2 `memory.max`, v1 `memory.limit_in_bytes`), since in
a container the kernel's figure is the host's and the cgroup limit is what the OOM killer enforces.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 reports "no limit" as a huge page-rounded number (2^63 - 4096 on x86-64).
_NO_LIMIT = 2**60


def available_memory_bytes(device: torch.device | str) -> int:
    """Bytes the next allocations on `device` can use (CUDA: free + cached unused; CPU: see the module)."""
    kind = device.type if not isinstance(device, str) else device.split(":")[0]
    if kind == "cuda":
        import torch  # the host's figures need no torch: a driver asks them without it

        free, _total = torch.cuda.mem_get_info(device)
        cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached_unused
    if kind == "cpu":
        available = meminfo_available_bytes()
        limit = cgroup_available_bytes()
        return available if limit is None else min(available, limit)
    raise ValueError(f"available_memory_bytes: no memory query for device type {kind!r} (cuda or cpu)")


def meminfo_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """`MemAvailable` of /proc/meminfo in bytes (the kernel's estimate of memory a new process can get)."""
    return _meminfo_bytes("MemAvailable", meminfo)


def total_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's memory (`MemTotal`), or this process's cgroup limit where that is lower."""
    total = _meminfo_bytes("MemTotal", meminfo)
    for base, (limit_file, _usage, _reclaimable) in _memory_cgroup_dirs(Path("/proc/self/cgroup"), CGROUP_ROOT):
        path = base / limit_file
        if path.is_file():
            text = path.read_text().strip()
            if text != "max" and int(text) < _NO_LIMIT:
                return min(total, int(text))
            break
    return total


def _meminfo_bytes(name: str, meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith(name + ":"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"{meminfo}: {name} in {unit!r}, expected 'kB'")
            return int(value) * 1024
    raise ValueError(f"{meminfo}: no {name} line (a kernel older than 3.14?)")


def cgroup_available_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroup still allows: limit - (usage - reclaimable page cache).

    None where no limit is set or no memory controller is visible. Only the process's own group is
    read (a limit set on a parent group alone is not seen).
    """
    for base, (limit_file, usage_file, reclaimable_key) in _memory_cgroup_dirs(proc_cgroup, root):
        if (base / limit_file).is_file():
            return _limit_minus_usage(base, limit_file, usage_file, reclaimable_key)
    return None


_V2_FILES = ("memory.max", "memory.current", "inactive_file")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _memory_cgroup_dirs(proc_cgroup: Path, root: Path) -> list[tuple[Path, tuple[str, str, str]]]:
    """Candidate folders of this process's memory cgroup, most specific first."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        # Inside a container the listed path may be the host's while the mount shows only our group,
        # hence the mount point itself as the last candidate.
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            dirs += [(base, _V2_FILES) for base in (root / relative, root / "unified" / relative, root)]
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            dirs += [(base, _V1_FILES) for base in (root / "memory" / relative, root / "memory")]
    # v1 first where both are listed: on a hybrid mount the memory controller lives in v1.
    return sorted(dirs, key=lambda d: d[1] is _V2_FILES)


def _limit_minus_usage(base: Path, limit_file: str, usage_file: str, reclaimable_key: str) -> int | None:
    limit_text = (base / limit_file).read_text().strip()
    if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
        return None
    usage = int((base / usage_file).read_text().strip())
    reclaimable = 0
    stat = base / "memory.stat"
    if stat.is_file():
        for line in stat.read_text().splitlines():
            key, value = line.split()
            if key == reclaimable_key:
                reclaimable = int(value)
                break
    return max(0, int(limit_text) - (usage - reclaimable))
