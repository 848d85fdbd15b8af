"""The deployment's command line on bad input: ``fedweave flower-executor`` against a node it cannot talk to
(TLS on one side only, a certificate it cannot verify, something that is not a SuperNode's Runtime API,
nothing at all) and with certificates it cannot use, and ``fedweave flower-app`` with empty paths. Each ends
in one line and status 2; an executor started before its node says so while it waits and runs once the node
answers. The nodes here are small HTTP servers on 127.0.0.1 in this process (no Flower process starts)."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flwr")

from benchmarks.federation import BIN, free_port  # noqa: E402
from fedweave.cli import main  # noqa: E402


class Node(BaseHTTPRequestHandler):
    """A stand-in for a SuperNode's Runtime API: an empty ``AcquireTaskResponse`` (no task) to every
    acquire-task, 404 to anything else; ``status`` makes it answer that instead (not a Runtime API)."""

    status = 200
    asked: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).asked.append(self.path)
        ok = self.status == 200 and self.path == "/v1/runtime/acquire-task"
        self.send_response(200 if ok else self.status if self.status != 200 else 404)
        self.send_header("content-type", "application/protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Server:
    """``handler`` on 127.0.0.1 (``port``: a chosen one, else any free one) in a thread, over TLS with
    ``tls = (certfile, keyfile)``."""

    def __init__(self, handler: type = Node, tls: tuple[Path, Path] | None = None, port: int = 0) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.handle_error = lambda request, address: None  # a client that gave up mid-handshake
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers: list[Server] = []

    def start(*args, **kwargs) -> Server:
        servers.append(Server(*args, **kwargs))
        return servers[-1]

    Node.asked = []
    yield start
    for s in servers:
        s.close()


def certificates(folder: Path, name: str = "ca") -> dict[str, Path]:
    """A CA (``<name>.pem``) and a certificate for 127.0.0.1 that it signed (``<name>-server.pem``, its key
    ``<name>-server.key``)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, signer, extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    paths = {"ca": folder / f"{name}.pem", "cert": folder / f"{name}-server.pem", "key": folder / f"{name}-server.key"}
    paths["ca"].write_bytes(
        cert(name, ca_key, name, ca_key, [(x509.BasicConstraints(ca=True, path_length=None), True)])
    )
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    paths["cert"].write_bytes(cert("127.0.0.1", key, name, ca_key, [(san, False)]))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def command(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """``fedweave ARGV`` in this process: its status (argparse's usage errors exit) and stderr's lines."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.splitlines()


def executor(capsys, *args: str) -> tuple[int, list[str]]:
    return command(capsys, ["flower-executor", *args])


def one_error(lines: list[str]) -> str:
    """The one error line the command ended with (after any warnings it gave while it waited)."""
    assert lines and lines[-1].startswith("fedweave: error: "), lines
    assert sum(line.startswith("fedweave: error:") for line in lines) == 1, lines
    assert all(line.startswith("fedweave: ") for line in lines), lines  # no traceback, no Flower log
    return lines[-1]


def test_the_executor_says_a_node_without_tls_needs_insecure(server, capsys):
    """Flower's own client ended in httpx's SSL traceback (``[SSL: WRONG_VERSION_NUMBER]``)."""
    node = server()
    code, lines = executor(capsys, "--runtime-api-address", node.address)
    assert code == 2
    assert one_error(lines) == (
        f"fedweave: error: the SuperNode's Runtime API at {node.address} does not speak TLS (a node started with "
        "--insecure): pass --insecure, or start the node with --ssl-certfile and --ssl-keyfile and give their CA "
        "with --root-certificates"
    )


def test_the_executor_with_insecure_says_a_tls_node_needs_its_ca(server, tmp_path):
    """Plain HTTP to a node that speaks TLS: the node hangs up on every request, which Flower's client retried
    forever, saying only 'Connection attempt failed'."""
    tls = certificates(tmp_path)
    node = server(tls=(tls["cert"], tls["key"]))
    args = ["flower-executor", "--insecure", "--runtime-api-address", node.address]
    done = subprocess.run([str(BIN / "fedweave"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert one_error(done.stderr.splitlines()) == (
        f"fedweave: error: the SuperNode's Runtime API at {node.address} speaks TLS (a node started with "
        "--ssl-certfile): leave out --insecure and give the CA of its certificate with --root-certificates"
    )


@pytest.mark.parametrize("trust", ["system", "other-ca"])
def test_the_executor_says_which_certificates_do_not_verify_the_node(server, tmp_path, capsys, trust):
    """A TLS node whose certificate the given CA (or the system's) does not verify: a traceback before."""
    tls = certificates(tmp_path)
    node = server(tls=(tls["cert"], tls["key"]))
    args = ["--runtime-api-address", node.address]
    which = "the system's CA certificates"
    if trust == "other-ca":
        other = certificates(tmp_path, "other")["ca"]
        args += ["--root-certificates", str(other)]
        which = f"--root-certificates {str(other)!r}"
    code, lines = executor(capsys, *args)
    assert code == 2
    line = one_error(lines)
    assert line.startswith(
        f"fedweave: error: the SuperNode's Runtime API at {node.address} has a certificate that {which} do not "
        "verify (certificate verify failed: "
    ), line
    assert line.endswith("): give the CA of the node's --ssl-certfile with --root-certificates"), line


def test_the_executor_runs_with_the_node_s_ca(server, tmp_path):
    """The happy path of the checks above: with the right CA the executor asks the node for tasks."""
    tls = certificates(tmp_path)
    node = server(tls=(tls["cert"], tls["key"]))
    args = ["flower-executor", "--runtime-api-address", node.address, "--root-certificates", str(tls["ca"])]
    p = subprocess.Popen([str(BIN / "fedweave"), *args], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(Node.asked) < 3 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert len(Node.asked) >= 3 and set(Node.asked) == {"/v1/runtime/acquire-task"}, p.poll()
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err == "fedweave: interrupted: terminated\n", err


@pytest.mark.parametrize("status", [404, 501])
def test_the_executor_says_what_is_not_a_runtime_api(server, capsys, status):
    """A web server at the address (the node's --port mistyped): httpx's HTTPStatusError traceback before."""
    Node.status = status
    try:
        node = server()
        code, lines = executor(capsys, "--insecure", "--runtime-api-address", node.address)
    finally:
        Node.status = 200
    assert code == 2
    reason = {404: "Not Found", 501: "Not Implemented"}[status]
    assert one_error(lines) == (
        f"fedweave: error: {node.address} is not a SuperNode's Runtime API: it answered the Runtime API's "
        f"acquire-task with HTTP {status} {reason}; give --runtime-api-address the --port of a SuperNode started "
        "with --isolation process"
    )


def test_the_executor_says_it_waits_and_gives_up_after_node_wait(capsys):
    """Nothing listens at the address: Flower's client retried forever without naming it."""
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    code, lines = executor(capsys, "--insecure", "--runtime-api-address", address, "--node-wait", "1.5")
    assert code == 2 and time.monotonic() - start < 60
    assert lines[0] == (
        f"fedweave: warning: no SuperNode's Runtime API answers at {address} yet ([Errno 111] Connection refused); "
        "retrying for up to 1.5 s (--node-wait)"
    )
    assert one_error(lines) == (
        f"fedweave: error: no SuperNode's Runtime API answered at {address} within --node-wait 1.5 s ([Errno 111] "
        "Connection refused); start the SuperNode with --isolation process and its --port, or check "
        "--runtime-api-address"
    )
    assert len(lines) == 2  # one line while it waits, however many times it retries


def test_the_executor_started_before_its_node_runs_once_the_node_answers(server):
    """A federation's processes start in any order: without --node-wait the executor waits for its node,
    saying so once, and then asks it for tasks."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ["flower-executor", "--insecure", "--runtime-api-address", address]
    p = subprocess.Popen([str(BIN / "fedweave"), *args], stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        timer = threading.Timer(120, p.kill)  # a line that never comes fails the test, not the suite
        timer.start()
        lines.append(p.stderr.readline())
        assert lines[0] == (
            f"fedweave: warning: no SuperNode's Runtime API answers at {address} yet ([Errno 111] Connection "
            "refused); retrying until one answers\n"
        )
        server(port=port)
        lines.append(p.stderr.readline())
        timer.cancel()
        assert lines[1] == f"fedweave: the SuperNode's Runtime API at {address} answers; running its ClientApp tasks\n"
        assert Node.asked and set(Node.asked) == {"/v1/runtime/acquire-task"}
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err == "fedweave: interrupted: terminated\n", err


@pytest.mark.parametrize("case", ["with-insecure", "missing", "folder", "not-pem", "binary", "a-key"])
def test_the_executor_refuses_root_certificates_it_cannot_use(tmp_path, capsys, case):
    """Flower's own checks ended in its multi-line 'Exit Code: 603/604' and status 1; a file that holds no
    certificate in a line that did not name the option."""
    path = tmp_path / "ca.pem"
    args = ["--runtime-api-address", f"127.0.0.1:{free_port()}", "--root-certificates", str(path)]
    if case == "with-insecure":
        path.write_text("")
        args.append("--insecure")
    elif case == "folder":
        path.mkdir()
    elif case == "not-pem":
        path.write_text("garbage\n")
    elif case == "binary":
        path.write_bytes(bytes(range(256)))
    elif case == "a-key":
        path.write_bytes(certificates(tmp_path)["key"].read_bytes())
    code, lines = executor(capsys, *args)
    assert code == 2
    want = {
        "with-insecure": "--root-certificates: --insecure talks to the SuperNode without TLS; give one of the two",
        "missing": f"--root-certificates {str(path)!r} does not exist; give the PEM file of the CA that signed the "
        "SuperNode's --ssl-certfile",
        "folder": f"--root-certificates {str(path)!r} is not a file; give the PEM file of the CA that signed the "
        "SuperNode's --ssl-certfile",
    }
    line = one_error(lines)
    assert len(lines) == 1
    if case in want:
        assert line == f"fedweave: error: {want[case]}"
    else:
        start = f"fedweave: error: --root-certificates {str(path)!r} holds no PEM CA certificate ("
        assert line.startswith(start), line
        assert line.endswith("); give the PEM file of the CA that signed the SuperNode's --ssl-certfile"), line


@pytest.mark.parametrize(
    "argv",
    [
        ["--runtime-api-address", "127.0.0.1:9", "--runtime-api-address", "127.0.0.1:10"],
        ["--runtime-api-address", "127.0.0.1:9", "--root-certificates", "a", "--root-certificates", "b"],
        ["--runtime-api-address", "127.0.0.1:9", "--node-wait", "1", "--node-wait", "2"],
    ],
)
def test_the_executor_takes_each_option_once(capsys, argv):
    """argparse took the last of an option given twice, without a word."""
    code, lines = executor(capsys, *argv)
    assert code == 2 and len(lines) == 1
    assert "is given twice" in lines[0] and "give it once" in lines[0], lines


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_the_executor_refuses_a_node_wait_that_is_not_seconds(capsys, value):
    code, lines = executor(capsys, "--insecure", "--runtime-api-address", "127.0.0.1:9", "--node-wait", value)
    assert code == 2
    assert lines == [
        f"fedweave: error: argument --node-wait: {value!r} is not a number of seconds > 0 "
        "(see 'fedweave flower-executor --help')"
    ]


def _config(tmp_path: Path, toy_config: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(toy_config))
    return str(path)


@pytest.mark.parametrize("which", ["dir", "--run-dir", "--node-data"])
def test_flower_app_refuses_an_empty_path(tmp_path, toy_config, capsys, monkeypatch, which):
    """An unset variable in ``fedweave flower-app run.yaml "$APP"`` wrote the app into the current folder;
    ``--node-data ""`` wrote no node data and ``--run-dir ""`` took the config's, without a word."""
    config = _config(tmp_path, toy_config)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    argv = ["flower-app", config, "" if which == "dir" else str(tmp_path / "app")]
    if which != "dir":
        argv += [which, ""]
    shown = "DIR" if which == "dir" else which
    assert command(capsys, argv) == (
        2,
        [f"fedweave: error: {shown} '': an empty path; give a directory (see 'fedweave flower-app --help')"],
    )
    assert not any(here.iterdir()) and not (tmp_path / "app").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--run-dir", "a", "--run-dir", "b"],
        ["--node-data", "a", "--node-data", "b"],
        ["--node-wait", "1", "--node-wait", "2"],
        ["--reply-timeout", "1", "--reply-timeout", "2"],
        ["--on-error", "stop", "--on-error", "drop"],
    ],
)
def test_flower_app_takes_each_option_once(tmp_path, toy_config, capsys, monkeypatch, argv):
    config = _config(tmp_path, toy_config)
    monkeypatch.chdir(tmp_path)  # the relative paths, were they taken
    code, lines = command(capsys, ["flower-app", config, str(tmp_path / "app"), *argv])
    assert code == 2 and len(lines) == 1 and "is given twice" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


@pytest.mark.parametrize("host", ["node1.example:9100", "tls-node.example:9100", "ssl.cluster.local:9100"])
def test_a_node_starting_behind_a_host_named_tls_is_retried_not_blamed_on_tls(host):
    """An HTTP status's message holds the URL: a 503 from a host named ``tls-node`` (a node still starting) was
    taken for a TLS failure, not retried, and a 404 from it named TLS, not the address, as the trouble."""
    import httpx
    from flwr.supercore.retry import make_simple_http_retry_invoker

    from fedweave.deploy.executor import Link

    def status(code: int) -> httpx.HTTPStatusError:
        request = httpx.Request("POST", f"http://{host}/v1/runtime/acquire-task")
        response = httpx.Response(code, request=request)
        message = f"Server error '{code}' for url '{request.url}'"
        return httpx.HTTPStatusError(message, request=request, response=response)

    link = Link(host, insecure=True, root_certificates=None, node_wait=None, report=lambda _: None)
    assert link.invoker(make_simple_http_retry_invoker).should_giveup(status(503)) is False
    assert str(link.error(status(404))).startswith(f"{host} is not a SuperNode's Runtime API")
