"""A rank that comes before rank 0 waits for rank 0's store in 10 ms steps, not torch's 0.5 s
backoff (orchestrate/diagnosis/joinwatch.py ``wait_for_store``).

What a user would check: a rank other than 0 does not call into torch before the store listens
(and then at once); rank 0, a program that brings its own store or another ``init_method``,
and a job without MASTER_ADDR are left exactly to torch; it gives up after its bound instead
of hanging; and a rank waiting there reads as "in init_process_group" to the stall watch.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta

import pytest

from orchestrate.diagnosis import joinwatch
from orchestrate.diagnosis.diagfiles import Frame
from orchestrate.diagnosis.joinwatch import wait_for_store
from orchestrate.diagnosis.sidecar import _frames, _in_init_process_group
from tests.support.ranks import free_port

pytestmark = pytest.mark.process



def _env(port: int, rank: str = "1") -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": rank}


def test_a_rank_waits_until_the_store_listens_then_goes_on() -> None:
    port = free_port()
    listening: list[float] = []
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.5)
        server.bind(("127.0.0.1", port))
        server.listen()
        listening.append(time.monotonic())

    opener = threading.Thread(target=listen_later)
    opener.start()
    try:
        wait_for_store(("gloo",), {}, _env(port))
        returned = time.monotonic()
    finally:
        opener.join()
        server.close()
    assert listening and returned >= listening[0]  # not before the store listened
    assert returned - listening[0] < 5.0  # and soon after (a bound a busy machine keeps)


@pytest.mark.parametrize("args, kwargs, env", [
    (("gloo",), {}, _env(1, rank="0")),  # rank 0 opens the store itself
    (("gloo",), {"store": object()}, _env(1)),  # the program's own store
    (("gloo", "tcp://127.0.0.1:1"), {}, _env(1)),  # another init_method
    (("gloo",), {"init_method": "file:///tmp/x"}, _env(1)),
    (("gloo",), {"rank": 0}, _env(1)),  # the rank as an argument wins over RANK
    (("gloo",), {}, {"RANK": "1"}),  # no MASTER_ADDR: torch says what is missing
])
def test_what_is_left_to_torch_returns_at_once(args: tuple[object, ...],
                                               kwargs: dict[str, object],
                                               env: dict[str, str]) -> None:
    started = time.monotonic()
    wait_for_store(args, kwargs, env)  # port 1: nothing listens; a wait would show
    assert time.monotonic() - started < 5.0


def test_it_waits_no_longer_than_the_job_s_own_timeout() -> None:
    started = time.monotonic()
    wait_for_store(("gloo",), {"timeout": timedelta(seconds=0.3)}, _env(free_port()))
    assert 0.3 <= time.monotonic() - started < 10.0  # not STORE_WAIT_S (60 s)


def test_it_gives_up_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joinwatch, "STORE_WAIT_S", 0.3)
    started = time.monotonic()
    wait_for_store(("gloo",), {}, _env(free_port()))  # nobody ever listens
    assert 0.3 <= time.monotonic() - started < 10.0


def test_a_rank_waiting_for_the_store_is_in_init_process_group() -> None:
    port = free_port()
    rank = threading.Thread(target=wait_for_store, args=(("gloo",), {}, _env(port)),
                            daemon=True)
    rank.start()
    stack: tuple[Frame, ...] = ()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(f.function == "wait_for_store"
                                                   for f in stack):
        stack, _ = _frames(sys._current_frames().get(rank.ident or 0), 40, 0, "/nonexistent")
        time.sleep(0.01)
    with socket.socket() as server:  # the store comes: the rank goes on
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        rank.join(timeout=30)
    assert _in_init_process_group(stack), stack
    assert not rank.is_alive()
