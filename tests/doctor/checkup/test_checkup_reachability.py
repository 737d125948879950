"""The connect tier's primitives against real loopback sockets, and as the shipped script.

What a user checks: a refused port, a port nobody answers and a working one are told apart
within the 3 s bound; the listener reports connectors by name; a taken port is an error at
once; the file runs with the standard library of Python 3.8.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrate.doctor.checkup import reachability
from orchestrate.doctor.checkup.reachability import Listener, connect, connect_all
from tests.support.python38 import python38 as _python38

pytestmark = [pytest.mark.process, pytest.mark.timing]

SCRIPT = Path(reachability.__file__)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_refused_port() -> None:
    got = connect("127.0.0.1", closed_port(), timeout=3)
    assert got["outcome"] == "refused" and got["seconds"] < 1


def test_listener_hears_named_connectors() -> None:
    listener = Listener()
    report: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: report.update(listener.serve(2, 5)))
    thread.start()
    results = connect_all([("127.0.0.1", listener.port)] * 2, timeout=3, hello="gpu07")
    thread.join(10)
    assert [r["outcome"] for r in results] == ["ok", "ok"]
    assert report["heard"] == [{"name": "gpu07", "address": "127.0.0.1"}] * 2
    assert report["seconds"] < 3, "returns as soon as everyone said hello"


def test_listener_that_never_accepts_times_out_connectors() -> None:
    """A full accept queue drops SYNs, like a firewall that DROPs: the connector gives up at
    its bound instead of hanging."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(0)
    port = squatter.getsockname()[1]
    try:
        began = time.monotonic()
        outcomes = [connect("127.0.0.1", port, timeout=1.5)["outcome"] for _ in range(4)]
        elapsed = time.monotonic() - began
    finally:
        squatter.close()
    assert outcomes[0] == "ok", "the kernel completes the first handshake itself"
    assert outcomes[-1] == "timeout"
    assert elapsed < 4 * 1.5 + 1


def test_listener_bound_is_kept_and_silent_connections_reported() -> None:
    listener = Listener()
    report: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: report.update(listener.serve(1, 1.5)))
    thread.start()
    with socket.create_connection(("127.0.0.1", listener.port)):
        thread.join(5)
    assert report["heard"] == [] and report["silent"] == ["127.0.0.1"]
    assert 1.0 <= report["seconds"] < 3


def test_taken_port_is_an_error_at_once() -> None:
    first = Listener()
    try:
        with pytest.raises(OSError):
            Listener(first.port)
    finally:
        first.close()


@pytest.mark.parametrize("python", [sys.executable, _python38()], ids=["this", "py38"])
def test_script_with_only_the_standard_library(python: str | None, tmp_path: Path) -> None:
    if python is None:
        pytest.skip("no Python 3.8 interpreter on this machine")
    listen = subprocess.Popen(
        [python, "-S", str(SCRIPT), "listen", "--expect", "1", "--seconds", "10"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        assert listen.stdout is not None
        port = json.loads(listen.stdout.readline())["listening"]
        done = subprocess.run(
            [python, "-S", str(SCRIPT), "connect", "--hello", "n2", f"127.0.0.1:{port}",
             f"127.0.0.1:{closed_port()}"], capture_output=True, text=True, timeout=20,
            cwd=tmp_path,
        )
        report = json.loads(listen.stdout.readline())
    finally:
        listen.kill()
        listen.wait()
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["outcome"] for r in lines] == ["ok", "refused"]
    assert done.returncode == 1, "a target failed"
    assert report["heard"] == [{"name": "n2", "address": "127.0.0.1"}]
