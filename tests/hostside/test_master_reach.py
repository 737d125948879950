"""The check that every node reaches MASTER_ADDR before launch, on real sockets of this machine
(loopback): a probe listener answers and lets go of the port for the real store; a port nobody
listens on, a name that does not resolve and a host that accepts TCP but never speaks SSH are
each named with their cause."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from orchestrate.backends.ssh.connections import ConnectError, Link, Target
from orchestrate.hostside.masterreach import listen, reach, resolve
from tests.support.ranks import free_port

pytestmark = pytest.mark.process



def test_a_probe_listener_answers_then_leaves_the_port_to_the_store() -> None:
    port = free_port()
    listener, answer = listen(port)
    assert answer == {"ok": True} and listener is not None
    for _ in range(3):  # several nodes connect
        assert reach("127.0.0.1", port) == {"ok": True, "via": "127.0.0.1"}
    listener.close()
    # The real store binds the same port at once (no TIME_WAIT left by the probe holds it).
    store = socket.create_server(("", port))
    store.close()


def test_a_port_nobody_listens_on_and_a_name_nobody_knows_are_named() -> None:
    port = free_port()
    refused = reach("127.0.0.1", port)
    assert refused["ok"] is False
    assert refused["detail"].startswith(f"cannot connect to MASTER_ADDR 127.0.0.1 port {port}: "
                                        "Connection refused")
    unknown = resolve("gpu-a.invalid")
    assert unknown["ok"] is False
    assert unknown["detail"].startswith("MASTER_ADDR gpu-a.invalid does not resolve here: ")
    assert reach("gpu-a.invalid", port) == unknown
    taken, _ = listen(port)
    assert taken is not None
    again, refusal = listen(port)
    assert again is None and refusal["detail"].startswith(f"cannot listen on master port {port}")
    taken.close()


@pytest.fixture
def silent_host() -> Iterator[int]:
    """A host that accepts TCP connections and never writes a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_host_that_never_speaks_is_named_within_its_timeout(silent_host: int) -> None:
    target = Target(name="quiet", address="127.0.0.1", python="python3", port=silent_host,
                    connect_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(ConnectError) as caught:
        Link(target).open()
    assert time.monotonic() - started < 30  # its own bound, not a hang
    assert caught.value.detail == (f"127.0.0.1:{silent_host} accepted TCP, no SSH banner "
                                   "within 2 s (is sshd running there, and is this its port?)")
    # And as a user meets it: probing the host names it the same way, exit 1.
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate", "inventory", "probe", "127.0.0.1", "--port",
         str(silent_host), "--connect-timeout", "2", "--no-torch"],
        capture_output=True, text=True, timeout=120, check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, said
    assert "accepted TCP, no SSH banner within 2 s" in said, said
    assert "No existing session" not in said
