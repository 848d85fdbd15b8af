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
import socket
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    return (AcquireTaskRequest, TaskType, RuntimeVersionHttpInterceptor, make_simple_http_retry_invoker,
            RuntimeHttpClient, run_clientapp)  # fmt: skip


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


def root_certificates_bytes(path: str | None, insecure: bool) -> bytes | None:
    """The CA certificates of ``--root-certificates`` (None: none given), checked before Flower is imported:
    Flower's own checks end the process with a multi-line message and status 1, and a file without a PEM
    certificate failed in a line that named neither the option nor the file."""
    if path is None:
        return None
    allowed = "give the PEM file of the CA that signed the SuperNode's --ssl-certfile"
    if insecure:
        raise ExecutorError("--root-certificates: --insecure talks to the SuperNode without TLS; give one of the two")
    file = Path(path).expanduser()
    if not file.exists():
        raise ExecutorError(f"--root-certificates {path!r} does not exist; {allowed}")
    if not file.is_file():
        raise ExecutorError(f"--root-certificates {path!r} is not a file; {allowed}")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise ExecutorError(f"--root-certificates {path!r} cannot be read ({e.strerror or _line(e)}); {allowed}") from e
    try:  # what Flower's client does with them (ProtobufClient.from_server_address)
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii"))
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError, UnicodeDecodeError a ValueError
        raise ExecutorError(f"--root-certificates {path!r} holds no PEM CA certificate ({_line(e)}); {allowed}") from e
    return data


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _speaks_tls(address: str) -> bool:
    """Whether the server at ``address`` completes a TLS handshake (its certificate not checked)."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock, context.wrap_socket(sock):
            return True
    except (OSError, ValueError):
        return False


class Link:
    """The executor's connection to its SuperNode's Runtime API, on Flower's retry invoker: it says once (not
    per try, as Flower's did, without the address) when the node does not answer, and when it answers again;
    gives up after ``node_wait`` seconds without an answer (None: never, as Flower's own executor: a
    federation's processes start in any order); and turns what no retry mends into one line (:meth:`error`)."""

    def __init__(self, address: str, *, insecure: bool, root_certificates: str | None, node_wait: float | None,
                 report: Callable[[str], None]) -> None:  # fmt: skip
        self.address, self.insecure, self.root_certificates = address, insecure, root_certificates
        self.node_wait, self.report = node_wait, report
        self.answered = self.waiting = self.tls = False
        self.last: Exception | None = None

    def invoker(self, make):
        """Flower's HTTP retry invoker from ``make`` (its backoff, and its rules for which answers to retry),
        with this link's reports and give-up."""
        invoker = make()
        flower_gives_up = invoker.should_giveup

        def gives_up(e: Exception) -> bool:
            if _tls_failure(e):  # Flower's logs 'SSL/TLS handshake error detected.' first
                return True
            if self.insecure and type(e).__name__ in ("RemoteProtocolError", "ReadError") and _speaks_tls(self.address):
                self.tls = True  # plain HTTP to a TLS node: it hangs up on every request
                return True
            return flower_gives_up(e)

        def on_backoff(state) -> None:
            self.last = state.exception
            if not self.waiting:
                self.waiting = True
                what = "stopped answering at" if self.answered else "answers at"
                until = (
                    f"for up to {self.node_wait:g} s (--node-wait)"
                    if self.node_wait is not None
                    else ("until it answers" if self.answered else "until one answers")
                )
                self.report(
                    f"warning: {'the' if self.answered else 'no'} SuperNode's Runtime API {what} {self.address}"
                    f"{'' if self.answered else ' yet'} ({_line(state.exception)}); retrying {until}"
                )

        def on_success(state) -> None:  # noqa: ARG001
            if self.waiting:
                self.report(f"the SuperNode's Runtime API at {self.address} answers; running its ClientApp tasks")
            self.answered, self.waiting = True, False

        invoker.should_giveup, invoker.on_backoff, invoker.on_success = gives_up, on_backoff, on_success
        invoker.on_giveup = None  # Flower's says 'Giving up reconnection', which error() says better
        invoker.wait_function = time.sleep  # Flower's says 'Connection attempt failed' at every try
        invoker.max_time = self.node_wait
        return invoker

    def error(self, e: Exception) -> ExecutorError | None:
        """The one line for ``e`` that ended an ask for a task, or None for an error not of the link."""
        import httpx

        at = f"the SuperNode's Runtime API at {self.address}"
        if self.tls:
            return ExecutorError(
                f"{at} speaks TLS (a node started with --ssl-certfile): leave out --insecure and give the CA of its "
                "certificate with --root-certificates"
            )
        if _tls_failure(e):
            if "WRONG_VERSION_NUMBER" in str(e) or "record layer failure" in str(e):
                return ExecutorError(
                    f"{at} does not speak TLS (a node started with --insecure): pass --insecure, or start the node "
                    "with --ssl-certfile and --ssl-keyfile and give their CA with --root-certificates"
                )
            if "CERTIFICATE_VERIFY_FAILED" in str(e):
                which = (f"--root-certificates {self.root_certificates!r}" if self.root_certificates
                         else "the system's CA certificates")  # fmt: skip
                why = _line(e).removeprefix("[SSL: CERTIFICATE_VERIFY_FAILED] ").split(" (_ssl.c")[0]
                return ExecutorError(
                    f"{at} has a certificate that {which} do not verify ({why}): give the CA of the node's "
                    "--ssl-certfile with --root-certificates"
                )
            return ExecutorError(f"TLS with {at} failed ({_line(e)}); check --insecure and --root-certificates")
        if isinstance(e, httpx.HTTPStatusError) and e.response.status_code not in (502, 503, 504):
            return ExecutorError(
                f"{self.address} is not a SuperNode's Runtime API: it answered the Runtime API's acquire-task with "
                f"HTTP {e.response.status_code} {e.response.reason_phrase}; give --runtime-api-address the --port of "
                "a SuperNode started with --isolation process"
            )
        if isinstance(e, httpx.TransportError | httpx.HTTPStatusError) and self.node_wait is not None:
            what = "stopped answering" if self.answered else "answered"
            return ExecutorError(
                f"{'the' if self.answered else 'no'} SuperNode's Runtime API {what} at {self.address} within "
                f"--node-wait {self.node_wait:g} s ({_line(e)}); start the SuperNode with --isolation process and "
                "its --port, or check --runtime-api-address"
            )
        if isinstance(e, ValueError) and "protobuf" in str(e):  # a 200 whose body is not the Runtime API's answer
            return ExecutorError(
                f"{self.address} is not a SuperNode's Runtime API: its answer to the Runtime API's acquire-task is "
                "not one; give --runtime-api-address the --port of a SuperNode started with --isolation process"
            )
        return None


def _tls_failure(e: Exception) -> bool:
    """Flower's test for a TLS failure (``make_simple_http_retry_invoker``), which it does not retry; never an
    HTTP status, whose message holds the URL (a host named ``tls-node`` answering 503 as it starts is retried)."""
    import httpx

    return not isinstance(e, httpx.HTTPStatusError) and any(t in str(e).lower() for t in ("certificate", "ssl", "tls"))


def _stderr(line: str) -> None:
    print(f"fedweave: {line}", file=sys.stderr, flush=True)


def serve(
    address: str,
    *,
    insecure: bool,
    root_certificates: str | None = None,
    poll: float = POLL,
    node_wait: float | None = None,
    report: Callable[[str], None] = _stderr,
) -> None:
    """Ask the SuperNode's Runtime API at ``address`` for ClientApp tasks and run each in a forked child,
    until interrupted (SIGINT/SIGTERM). ``node_wait``: seconds without an answer from the node (at start, or
    once it stopped answering) before an ExecutorError (None: wait for it). ``report``: where the lines
    about the wait go (``warning: ...`` while it waits, a line when the node answers again)."""
    check_address(address)
    certificates = root_certificates_bytes(root_certificates, insecure)
    (AcquireTaskRequest, TaskType, VersionInterceptor, retry_invoker, RuntimeHttpClient,
     run_clientapp) = _flower()  # fmt: skip
    import torch  # noqa: F401  (warm: the children inherit the imports)

    import fedweave.deploy.client_app  # noqa: F401

    link = Link(address, insecure=insecure, root_certificates=root_certificates, node_wait=node_wait, report=report)
    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=certificates,
        interceptors=[VersionInterceptor(component_name="SuperExec")], retry_invoker=link.invoker(retry_invoker),
    )  # fmt: skip
    children: set[int] = set()
    log.info("fedweave flower-executor: running ClientApp tasks of the SuperNode at %s", address)
    try:
        while True:
            try:
                res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            except Exception as e:
                if (error := link.error(e)) is None:
                    raise
                raise error from e
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
