"""Memory and CPU time of a process tree, read from /proc (Linux): what run summaries, benchmarks and memory
tests measure."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (e.g. Ray workers started by this process)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def memory(pids: list[int]) -> dict[str, int]:
    """Summed RSS, PSS (shared pages divided among the processes that map them), and the PSS of anonymous
    memory (heaps) and of shared memory (e.g. Ray's object store in /dev/shm) of ``pids``, in bytes."""
    out = {"rss": 0, "pss": 0, "anon": 0, "shmem": 0}
    keys = {"Rss:": "rss", "Pss:": "pss", "Pss_Anon:": "anon", "Pss_Shmem:": "shmem"}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                k = keys.get(line.split(maxsplit=1)[0]) if line else None
                if k:
                    out[k] += int(line.split()[1]) * 1024
        except OSError:
            continue
    return out


def cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) used so far by this process, its finished children and its
    live descendants (the pool backend's workers, a local Ray's processes) with the children they have waited
    for. Without /proc: this process and its finished children only."""
    own, done = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime
    if not Path("/proc/self/stat").exists():
        return total
    tick = os.sysconf("SC_CLK_TCK")
    for pid in process_tree(os.getpid())[1:]:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        # utime and stime, and cutime and cstime: its own finished children (a raylet's exited workers), which
        # it has waited for and which RUSAGE_CHILDREN will count only once it is itself waited for
        total += (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / tick
    return total


class PeakMemory:
    """The peak memory (``memory()``'s RSS, PSS, anonymous and shared-memory parts, each its own maximum) of
    the process tree under ``root`` (default: this process, with its pool workers or Ray processes), sampled
    every ``interval`` seconds by a daemon thread between ``start()`` and ``stop()`` (or a ``with`` block).
    ``per_process`` holds each process's own peaks, so that a regression shows where it lives (the driver or
    a worker)."""

    def __init__(self, root: int | None = None, interval: float = 0.1) -> None:
        import threading

        self.root, self.interval = root or os.getpid(), interval
        self.peak = {"rss": 0, "pss": 0, "anon": 0, "shmem": 0}
        self.per_process: dict[int, dict[str, int]] = {}  # pid -> its own peaks (the root first)
        self.processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        """Take one sample now."""
        pids = process_tree(self.root)
        total = dict.fromkeys(self.peak, 0)
        for pid in pids:
            one = memory([pid])
            mine = self.per_process.setdefault(pid, dict.fromkeys(self.peak, 0))
            for k, v in one.items():
                total[k] += v
                mine[k] = max(mine[k], v)
        for k, v in total.items():
            self.peak[k] = max(self.peak[k], v)
        self.processes = max(self.processes, len(pids))

    def start(self) -> PeakMemory:
        """Start sampling (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        """Stop sampling (after a last sample); the peaks, bytes."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
