"""A warm executor for a SuperNode started with ``--isolation process`` (``fedweave flower-executor``).

Flower runs every message a SuperNode receives in a fresh ``ClientApp`` process: with the default isolation
(``subprocess``) the node's ``flower-superexec`` starts one ``flwr-clientapp`` per message, which imports
Flower, torch and fedweave again (about 2 s of CPU each, before any training; docs/deployment.md). Flower
offers no long-lived ClientApp; its ``process`` isolation mode instead leaves starting the ClientApp
processes to an executor outside the node. This is one: it imports Flower's ClientApp runtime, torch and
fedweave's ClientApp once, then, for every task the node hands out, forks a child that runs Flower's own
``run_clientapp`` for that task (pull the message and context, run the app, push the reply and context) and
exits. Each message still runs in its own process, so nothing leaks from one job to the next; only the
imports are shared.

It speaks Flower's Runtime API as ``flower-superexec`` does (the same requests, from the same modules), which
is internal to Flower and changes between its releases: the ``flower`` extra of fedweave's ``pyproject.toml``
pins the Flower release this speaks (``FLOWER``; a test keeps the two equal), and the executor refuses any
other installed Flower with one line.
"""

from __future__ import annotations

import logging
import os
import time

from fedweave.config import is_host_port

log = logging.getLogger("fedweave")
FLOWER = (1, 42)  # the Flower release (major, minor) whose Runtime API this speaks: pyproject pins flwr to it
POLL = 0.2  # seconds between two asks for a task


class ExecutorError(RuntimeError):
    """The installed Flower is not one this executor speaks to."""


def _flower():
    """Flower's pieces the executor uses (imported here: ``fedweave`` itself never imports flwr)."""
    import flwr

    version = str(getattr(flwr, "__version__", ""))
    if tuple(version.split(".")[:2]) != tuple(map(str, FLOWER)):
        major, minor = FLOWER
        raise ExecutorError(
            f"fedweave flower-executor speaks the Runtime API of Flower {major}.{minor}.x (pip install "
            f"'flwr>={major}.{minor},<{major}.{minor + 1}', as fedweave[flower] pins it); this is Flower {version}: "
            "install that release, or start the SuperNode with its default --isolation subprocess instead"
        )
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # noqa: PLC0415
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    return (AcquireTaskRequest, TaskType, RuntimeVersionHttpInterceptor, make_simple_http_retry_invoker,
            RuntimeHttpClient, validate_and_resolve_root_certificates, run_clientapp)  # fmt: skip


def _run_child(run_clientapp, address: str, token: str, insecure: bool, certificates: bytes | None) -> None:
    """The forked child: Flower's ClientApp runtime for one task, then exit without returning."""
    code = 1
    try:
        run_clientapp(runtime_api_address=address, token=token, insecure=insecure, certificates=certificates,
                      runtime_dependency_install=False)  # fmt: skip
        code = 0
    except SystemExit as e:  # Flower's runtime ends with sys.exit
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os._exit(code)


def check_address(address: str) -> None:
    """``HOST:PORT`` with a port 1 to 65535, else one ExecutorError naming the flag: Flower's client retried
    ``notanaddress`` or ``127.0.0.1:99999`` forever, saying only that a connection attempt failed."""
    if not is_host_port(address):
        raise ExecutorError(
            f"--runtime-api-address must be HOST:PORT with a port from 1 to 65535 (the SuperNode's Runtime API, "
            f"its --port), got {address!r}"
        )


def serve(address: str, *, insecure: bool, root_certificates: str | None = None, poll: float = POLL) -> None:
    """Ask the SuperNode's Runtime API at ``address`` for ClientApp tasks and run each in a forked child,
    until interrupted (SIGINT/SIGTERM)."""
    check_address(address)
    (AcquireTaskRequest, TaskType, VersionInterceptor, retry_invoker, RuntimeHttpClient, resolve_certificates,
     run_clientapp) = _flower()  # fmt: skip
    import torch  # noqa: F401  (warm: the children inherit the imports)

    import fedweave.deploy.client_app  # noqa: F401

    certificates = resolve_certificates(root_certificates, insecure)
    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=certificates,
        interceptors=[VersionInterceptor(component_name="SuperExec")], retry_invoker=retry_invoker(),
    )  # fmt: skip
    children: set[int] = set()
    log.info("fedweave flower-executor: running ClientApp tasks of the SuperNode at %s", address)
    try:
        while True:
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            if res.HasField("task") and res.token:
                pid = os.fork()
                if pid == 0:
                    _run_child(run_clientapp, address, res.token, insecure, certificates)
                children.add(pid)
            for pid in list(children):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
            time.sleep(poll)
    finally:
        client.close()
