"""Memory of a process tree, read from /proc (Linux): what benchmarks and memory tests measure."""

from __future__ import annotations

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
