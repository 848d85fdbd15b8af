"""A local Flower federation of real processes on 127.0.0.1, for tests/test_deploy_flower.py and
benchmarks/deploy_overhead.py: a ``flower-superlink --insecure``, ``flower-supernode``s (each with a warm
``fedweave flower-executor`` under ``--isolation process``), ``flwr run`` against them, and a stop that leaves no
process behind. Each process is the leader of its own process group, so that stopping it also ends what it started
(Flower's SuperExec, the ServerApp, the ClientApps). Only the executables are needed, from this interpreter's
environment (the ``flower`` extra); nothing of Flower is imported here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode, flwr and fedweave of this environment


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Federation:
    """A SuperLink and SuperNodes under ``root`` (their files, Flower's home and each process's ``<name>.log``);
    ``stop`` ends every process group it started, even after a failure.

    ``task_poll``: how often (s) Flower's executors look for a task (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, a
    documented setting; 1 s by default): the SuperLink's, which starts the ServerApp, and the nodes' under
    ``--isolation subprocess``."""

    def __init__(self, root: Path, task_poll: float) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.port = free_port()
        home = root / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        # the SuperLink and SuperNodes start Flower's other executables (flower-superexec, ...) from PATH
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {**os.environ, "FLWR_HOME": str(home), "PATH": path}
        self.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(task_poll)

    def popen(self, args: tuple[str, ...], stdout: int | IO[bytes]) -> subprocess.Popen:
        """Start the executable ``args[0]`` of this environment with ``args[1:]`` in a process group of its own,
        its output and errors to ``stdout``; ``stop`` ends it."""
        p = subprocess.Popen([str(BIN / args[0]), *args[1:]], env=self.env, cwd=self.root, stdout=stdout,
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """``popen`` with the output appended to ``root/<name>.log`` (a subclass may take it otherwise)."""
        with open(self.root / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
            return self.popen(args, log)

    def superlink(self) -> subprocess.Popen:
        """Start the SuperLink (``superlink``) with Flower's default in-memory state (a ``--database`` file costs
        the SuperLink more than twice the CPU time, every look for a reply a write); ``wait_listening`` waits for
        it."""
        return self.start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port",
                          str(self.port), "--disable-runtime-dependency-installation")  # fmt: skip

    def wait_listening(self, timeout: float = 60) -> None:
        """Return once the SuperLink accepts connections; TimeoutError (with the logs) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the SuperLink did not listen on port {self.port}:\n{self.logs()}")

    def start_node(
        self, client: int, node_config: str, isolation: str = "process", name: str = "supernode"
    ) -> tuple[subprocess.Popen, subprocess.Popen | None]:
        """Start the SuperNode ``<name>-<client>`` with ``--node-config node_config``, and under ``--isolation
        process`` its ``fedweave flower-executor`` (``executor-<client>``: one warm process that forks a child per
        message); ``subprocess`` is Flower's default (a fresh ClientApp process per message, no executor)."""
        port = str(free_port())  # the node's Runtime API, where its executor asks for work
        node = self.start(
            f"{name}-{client}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
            "--port", port, "--node-config", node_config, "--isolation", isolation,
        )  # fmt: skip
        executor = None
        if isolation == "process":
            executor = self.start(f"executor-{client}", "fedweave", "flower-executor", "--insecure",
                                  "--runtime-api-address", f"127.0.0.1:{port}")  # fmt: skip
        return node, executor

    def flwr_run(self, app: Path, *, wait: bool = True, timeout: float = 300):
        """``flwr run app local --stream``: its CompletedProcess (text), or with ``wait=False`` the running
        process, its errors in its output."""
        cmd = [str(BIN / "flwr"), "run", str(app), "local", "--stream"]
        if wait:
            return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        return subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> None:
        """SIGTERM every process group still running, then SIGKILL the ones not gone within 10 s."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def logs(self) -> str:
        """The last 3000 characters of each process's log."""
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in self.root.glob("*.log"))
