"""The host memory guard: know the process's host limit, warn before it, stop a fit cleanly.

A container job whose host memory grows step after step is ended by the kernel's OOM killer with
SIGKILL: no exception, no checkpoint, no line in the log. This module finds the limit that killer
enforces (the tightest of the cgroup's limit and total RAM), reads what counts against it, and
decides once per training batch whether to do nothing, warn, or stop. The callback calls it; the
Lightning side (saving the checkpoint, ``trainer.should_stop``) stays in ``lightmem/callback.py``.

Where the limit comes from:

- cgroup v2: ``memory.max`` of the process's cgroup and of each ancestor up to the mount point
  (``"max"`` means none); usage is ``memory.current`` less ``inactive_file`` of ``memory.stat``.
- cgroup v1: ``memory.limit_in_bytes`` the same way (a value near 2**63 means none); usage is
  ``memory.usage_in_bytes`` less ``total_inactive_file``.
- total RAM, always; when it is the tightest limit, usage is the RSS of this process and its
  children (DataLoader workers).

Inactive file cache is subtracted because the kernel reclaims it before it kills anyone (the same
"working set" rule the kubelet uses to evict pods). The cgroup is found through
``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (the standard mount points when mountinfo
cannot be read), once, when the guard is built; the files read every batch stay open, and each
check is one ``pread`` per file (procfs and cgroupfs regenerate a file read at offset 0).
"""

from __future__ import annotations

import collections
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from lightmem.config import format_bytes, total_ram_bytes
from lightmem.metrics.names import GiB, key

NO_LIMIT_BYTES = 1 << 60
"""cgroup v1 writes "no limit" as LONG_MAX rounded down to a page; anything this big is no limit."""

GROWTH_WINDOW = 10
"""Growth per batch is measured over the last this-many batches."""


_V1_STANDARD_MOUNT = "/sys/fs/cgroup/memory"
_V2_STANDARD_MOUNT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class HostLimit:
    """The host memory limit that applies to this process, and where its usage is read."""

    limit_bytes: int
    source: str
    """Where the limit comes from, in words: ``"cgroup v1 /sys/fs/cgroup/memory/job"``, ``"total RAM"``."""
    usage_file: str | None = None
    """``memory.current`` / ``memory.usage_in_bytes`` of the limiting cgroup; None: process tree RSS."""
    stat_file: str | None = None
    reclaimable_key: str | None = None
    """The ``memory.stat`` line subtracted from usage (reclaimable file cache)."""


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def _cgroup_mounts(mountinfo: str) -> list[tuple[int, str, str]]:
    """``(version, root, mount point)`` of every memory cgroup mount in ``/proc/self/mountinfo``."""
    try:
        text = _read(mountinfo)
    except OSError:
        return [(1, "/", _V1_STANDARD_MOUNT), (2, "/", _V2_STANDARD_MOUNT)]
    mounts = []
    for line in text.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            mounts.append((2, root, mount_point))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.append((1, root, mount_point))
    return mounts


def _cgroup_paths(proc_cgroup: str) -> dict[int, str]:
    """The process's cgroup path in the v1 memory hierarchy and in the v2 hierarchy."""
    paths: dict[int, str] = {}
    try:
        text = _read(proc_cgroup)
    except OSError:
        return paths
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def _levels(version: int, root: str, mount_point: str, path: str) -> list[str]:
    """The process's cgroup directory and its ancestors up to the mount point, innermost first."""
    relative = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        relative = path[len(root.rstrip("/")) :]  # a container sees its own cgroup as the root
    directory = os.path.normpath(os.path.join(mount_point, relative.lstrip("/")))
    if not os.path.isdir(directory):
        directory = mount_point  # a namespaced /proc/self/cgroup path that is not mounted here
    levels = [directory]
    while directory != mount_point and directory.startswith(mount_point):
        directory = os.path.dirname(directory)
        levels.append(directory)
    return levels


def own_cgroups(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> list[tuple[int, list[str]]]:
    """``(version, [directory, parent, ..., mount point])`` of this process's memory cgroups."""
    paths = _cgroup_paths(proc_cgroup)
    return [
        (version, _levels(version, root, mount_point, paths[version]))
        for version, root, mount_point in _cgroup_mounts(mountinfo)
        if version in paths
    ]


def cgroup_limits(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> list[HostLimit]:
    """Every memory limit set on this process's cgroup or an ancestor (v1 and v2), unordered."""
    limits = []
    for version, levels in own_cgroups(proc_cgroup, mountinfo):
        limit_name, usage_name, reclaimable = (
            ("memory.max", "memory.current", "inactive_file")
            if version == 2
            else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        )
        for directory in levels:
            try:
                value = _read(os.path.join(directory, limit_name)).strip()
            except OSError:
                continue  # no memory controller at this level (v2 without +memory, hybrid setups)
            if value == "max" or not value.isdigit() or int(value) >= NO_LIMIT_BYTES:
                continue
            limits.append(
                HostLimit(
                    int(value), f"cgroup v{version} {os.path.join(directory, limit_name)}",
                    os.path.join(directory, usage_name), os.path.join(directory, "memory.stat"), reclaimable,
                )
            )  # fmt: skip
    return limits


def discover_limit(
    proc_cgroup: str = "/proc/self/cgroup",
    mountinfo: str = "/proc/self/mountinfo",
    ram_bytes: int | None = None,
) -> HostLimit:
    """The tightest host memory limit of this process: its cgroups' limits and total RAM."""
    ram = HostLimit(total_ram_bytes() if ram_bytes is None else ram_bytes, "total RAM")
    return min([ram, *cgroup_limits(proc_cgroup, mountinfo)], key=lambda limit: limit.limit_bytes)


def cgroup_usage_bytes(limit: HostLimit) -> int:
    """What counts against a cgroup limit and cannot be reclaimed: usage less inactive file cache."""
    assert limit.usage_file is not None and limit.stat_file is not None
    return _usage_less_reclaimable(_read(limit.usage_file), _read(limit.stat_file), limit.reclaimable_key or "")


def _usage_less_reclaimable(usage_text: str | bytes, stat_text: str | bytes, reclaimable_key: str) -> int:
    stat = stat_text.decode() if isinstance(stat_text, bytes) else stat_text
    usage = int(usage_text)
    start = ("\n" + stat).find(f"\n{reclaimable_key} ")
    if start >= 0:
        end = stat.find("\n", start)
        usage -= int(stat[start + len(reclaimable_key) + 1 : end if end >= 0 else None])
    return max(usage, 0)


class _OpenFiles:
    """Small procfs/cgroupfs files kept open and re-read with one ``pread`` each."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def read(self, path: str, size: int = 65536) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, size, 0)

    def forget(self, keep: set[str]) -> None:
        for path in [path for path in self._fds if path not in keep]:
            os.close(self._fds.pop(path))

    def close(self) -> None:
        self.forget(set())


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def batches_loaded_ahead(loaders: object) -> int:
    """Batches the DataLoaders' workers may load ahead of training: ``num_workers * prefetch_factor``."""
    if isinstance(loaders, dict):
        return sum(batches_loaded_ahead(loader) for loader in loaders.values())
    if isinstance(loaders, (list, tuple)):
        return sum(batches_loaded_ahead(loader) for loader in loaders)
    workers = getattr(loaders, "num_workers", 0)
    if not isinstance(workers, int) or workers <= 0:
        return 0
    return workers * (getattr(loaders, "prefetch_factor", None) or 2)


class HostGuard:
    """Watches host memory against its limit once per training batch and says when to warn or stop.

    Args:
        limit: a limit found by :func:`discover_limit`, a byte count (usage is then the RSS of this
            process and its children), or None to discover it now.
        warn_at: fraction of the limit at which to warn once.
        stop_at: fraction of the limit at which to stop; None: never stop.
        host_buffers_bytes: bytes of host buffers lightmem holds (for the message).
    """

    group = "host"

    def __init__(
        self,
        limit: HostLimit | int | None,
        warn_at: float,
        stop_at: float | None,
        host_buffers_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        if limit is None:
            limit = discover_limit()
        self.limit = limit if isinstance(limit, HostLimit) else HostLimit(limit, "host_limit")
        self.warn_at = warn_at
        self.stop_at = stop_at
        self._host_buffers_bytes = host_buffers_bytes
        self._process = psutil.Process()
        self._files = _OpenFiles()
        self._children: list[int] = []
        self._children_file = f"/proc/self/task/{os.getpid()}/children"
        if not os.path.exists(self._children_file):  # kernels without CONFIG_PROC_CHILDREN
            self._children_file = ""
        self._checks = 0
        self._history: collections.deque[int] = collections.deque(maxlen=GROWTH_WINDOW)
        self.warned = False
        self.stopped = False
        self.batches_ahead = 0
        """Batches DataLoader workers load ahead of training (see :func:`batches_loaded_ahead`): they
        keep growing while the checkpoint is saved, so the stop looks that many batches further."""

    def usage_bytes(self) -> int:
        """Bytes that count against the limit now."""
        limit = self.limit
        if limit.usage_file is not None and limit.stat_file is not None:
            return _usage_less_reclaimable(
                self._files.read(limit.usage_file, 64), self._files.read(limit.stat_file), limit.reclaimable_key or ""
            )
        return self._rss("/proc/self/statm") + self.workers_rss_bytes()

    def _rss(self, statm: str) -> int:
        return int(self._files.read(statm, 128).split()[1]) * _PAGE_BYTES

    def workers_rss_bytes(self) -> int:
        """RSS of this process's children (DataLoader workers).

        Forked workers share the parent's pages until they write them; RSS counts those in each.
        """
        if self._children_file:
            children = [int(pid) for pid in self._files.read(self._children_file).split()]
        else:
            children = [child.pid for child in self._process.children()]
        if children != self._children:
            self._children = children
            self._files.forget({"/proc/self/statm", self._children_file, self.limit.usage_file, self.limit.stat_file})  # type: ignore[arg-type]
        total = 0
        for pid in children:
            try:
                total += self._rss(f"/proc/{pid}/statm")
            except (OSError, ValueError, IndexError):
                pass  # a worker that exited since the list was read
        return total

    def close(self) -> None:
        """Close the files kept open for the checks."""
        self._files.close()

    def growth_per_batch_bytes(self) -> float:
        """Mean growth of usage per batch over the last batches (0 before two checks)."""
        if len(self._history) < 2:
            return 0.0
        return (self._history[-1] - self._history[0]) / (len(self._history) - 1)

    def check(self) -> str:
        """Read usage once and return ``"stop"``, ``"warn"`` (once) or ``"ok"``.

        Stops when usage has reached ``stop_at`` of the limit, or would reach it within the next
        batch (plus the batches DataLoader workers load ahead) at the current growth: the check
        runs between batches, and a batch that crosses the limit itself is killed before the next
        check can act.
        """
        usage = self.usage_bytes()
        self._checks += 1
        self._history.append(usage)
        return self._verdict(usage)

    def recheck(self) -> str:
        """The verdict on a fresh reading, without counting it as a batch (after releasing buffers)."""
        usage = self.usage_bytes()
        self._history[-1] = usage
        return self._verdict(usage)

    def _verdict(self, usage: int) -> str:
        if self.stopped:
            return "ok"
        limit = self.limit.limit_bytes
        ahead = 1 + self.batches_ahead
        if self.stop_at is not None and usage + ahead * max(self.growth_per_batch_bytes(), 0.0) >= self.stop_at * limit:
            return "stop"
        if not self.warned and usage >= self.warn_at * limit:
            self.warned = True
            return "warn"
        return "ok"

    def batches_left(self, fraction: float) -> int | None:
        """Batches until usage reaches ``fraction`` of the limit at the current growth; None if flat."""
        growth = self.growth_per_batch_bytes()
        if growth <= 0 or not self._history:
            return None
        return max(int((fraction * self.limit.limit_bytes - self._history[-1]) // growth), 0)

    def describe(self) -> str:
        """Where the host memory is: usage against the limit, its holders, growth per batch."""
        usage = self._history[-1] if self._history else self.usage_bytes()
        limit = self.limit.limit_bytes
        rss = self._rss("/proc/self/statm")
        workers = self.workers_rss_bytes()
        return "\n".join(
            [
                f"host memory in use: {format_bytes(usage)} of {format_bytes(limit)} "
                f"({usage / limit:.0%}; limit from {self.limit.source})",
                f"  this process (RSS):         {format_bytes(rss)}",
                f"  DataLoader workers (RSS):   {format_bytes(workers)} in {len(self._children)} processes"
                + (" (pages shared with this process counted in each)" if self._children else ""),
                f"  lightmem host buffers:      {format_bytes(self._host_buffers_bytes())}",
                f"  growth per training batch:  {format_bytes(self.growth_per_batch_bytes())} "
                f"(mean of the last {max(len(self._history) - 1, 1)} batches)",
            ]
        )

    def warning_message(self) -> str:
        stop = self.stop_at if self.stop_at is not None else 1.0
        left = self.batches_left(stop)
        what = "LightMem stops training cleanly" if self.stop_at is not None else "the OOM killer ends the job"
        when = f"in about {left} batch{'' if left == 1 else 'es'} at this rate" if left is not None else "if it keeps growing"
        return (
            f"lightmem: host memory passed host_warn_at ({self.warn_at:.0%} of its limit); {what} "
            f"at {stop:.0%} {when}.\n{self.describe()}\n{_GROWTH_HINT}"
        )

    def stop_message(self, checkpoint_path: str | None, save_error: BaseException | None = None) -> str:
        assert self.stop_at is not None
        if checkpoint_path is not None and save_error is None:
            saved = (
                f"A checkpoint was saved to {checkpoint_path}. Resume with "
                f"trainer.fit(model, ckpt_path={checkpoint_path!r}) once the memory growth is fixed "
                "or the limit raised."
            )
        else:
            saved = f"Saving the checkpoint to {checkpoint_path} failed ({save_error!r}); nothing to resume from."
        return (
            f"lightmem: training stopped cleanly: host memory reached host_stop_at ({self.stop_at:.0%} of "
            f"its limit) or would within the next batch, and the OOM killer would have ended the job "
            f"without a trace.\n{self.describe()}\n{saved}\n{_GROWTH_HINT}"
        )

    # -- metrics: the guard is a probe of the "host" group -------------------------------------

    def collect(self) -> dict[str, float]:
        usage = self._history[-1] if self._history else self.usage_bytes()
        return {
            key("host/limit_GiB"): self.limit.limit_bytes / GiB,
            key("host/headroom_GiB"): (self.limit.limit_bytes - usage) / GiB,
            key("host/workers_rss_GiB"): self.workers_rss_bytes() / GiB,
        }

    def end_step(self) -> None:
        return None

    def on_training_batch(
        self, trainer: Any, release_host_memory: Callable[[], None] | None, checkpoint_path: str | None
    ) -> None:
        """Check once, after a training batch; warn, or stop the fit cleanly with a checkpoint.

        Stopping first gives lightmem's cached host buffers back (``release_host_memory``) and
        checks again; if usage is still over, every rank saves ``checkpoint_path`` (default
        ``<default_root_dir>/lightmem-host-stop.ckpt``), ``trainer.should_stop`` is set and ``fit``
        returns normally. Every batch, not only logged steps: memory that grows per batch outruns
        any logging interval.
        """
        verdict = self.check()
        if verdict == "stop" and release_host_memory is not None:
            release_host_memory()
            verdict = self.recheck()
        if trainer.world_size > 1:  # every rank saves and stops, or none (save_checkpoint is collective)
            stop = trainer.strategy.reduce_boolean_decision(verdict == "stop", all=False)
            verdict = "stop" if stop else verdict
        if verdict == "warn":  # from every rank: each watches its own host
            warnings.warn(self.warning_message(), UserWarning, stacklevel=2)
        elif verdict == "stop":
            self.stopped = True
            path = checkpoint_path or os.path.join(trainer.default_root_dir, "lightmem-host-stop.ckpt")
            error: BaseException | None = None
            try:
                trainer.save_checkpoint(path)
            except Exception as save_error:  # the job still stops rather than be killed
                error = save_error
            trainer.should_stop = True
            print(self.stop_message(path, error), file=sys.stderr, flush=True)


_GROWTH_HINT = (
    "Host memory that grows every batch is usually kept on purpose or by mistake: tensors appended to "
    "a list across steps (log loss.item(), not the loss with its graph), features built dense all at "
    "once (one-hot a batch at a time instead), or DataLoader workers caching items."
)
