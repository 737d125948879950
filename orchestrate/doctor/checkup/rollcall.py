"""The roll call: before any process group exists, every node's leader says hello on
MASTER_ADDR:MASTER_PORT, where node 0's leader listens.

It is the connect tier's first test (can every node open a TCP connection to the master's port,
the one the job's rendezvous store will use?), and it gives each node what the rest of the
connect and static tiers need, which no other channel gives before the store exists:

- the directory: every node's address (as the master saw the connection come in, which is the
  address that routes) and the ephemeral port its node-to-node listener got from the kernel;
- node 0's clock: the directory carries node 0's ``time.time()`` when it was sent, so each node
  estimates its clock offset against node 0 as ``its time at receipt - node 0's time``, wrong
  by at most the one-way network latency (well under the 1 s that grading warns at). Node 0,
  not the controller, is the reference because the nodes have no channel to the controller
  while they run (on SSH and Slurm only their output comes back), and what an offset breaks
  (merged logs, stall times across nodes, MUNGE credentials) is a difference between nodes.

Protocol: a leader connects (each try bounded by 3 s, retried every 0.5 s until the window
ends: node 0 may not listen yet), sends one line ``orchestrate-rollcall {json}`` and waits for
one JSON line ``{"directory": [...], "time": t}``, which node 0 sends to everyone once all
expected nodes said hello or its window ended (so a leader, once connected, waits up to one
window: node 0's began before the connection). Anything else that connects (a rank's store
client, early) is closed at once, and so is a hello that is not one of the planned nodes': not a
JSON object, a node name outside the plan's (when the plan names its nodes; Slurm chooses the
hosts, so there the group rank must be one of the plan's), or a node that already said hello.
Whatever reaches the port, the roll call goes on and names only the nodes it heard. Node 0 then
releases the port, so the smoke tier's store can bind it.

Standard library only (it runs before torch is imported; the connect tier stays cheap).
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Sequence
from typing import Any

from orchestrate.doctor.checkup.reachability import CONNECT_TIMEOUT_S, open_connection

HELLO = b"orchestrate-rollcall "
#: Between tries of a leader whose connection failed (node 0 may not listen yet).
RETRY_S = 0.5
#: How long node 0 waits for a connection's first line before closing it as not a leader.
FIRST_LINE_S = 2.0
_MAX_LINE = 1 << 16


class RollCall:
    """Node 0's side: bound at construction (an OSError: the port is taken, or not allowed)."""

    def __init__(self, port: int, host: str = "") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(256)
        except OSError:
            self.sock.close()
            raise
        self.port = int(self.sock.getsockname()[1])

    def serve(self, expect: int, seconds: float, names: Sequence[str] = ()) -> dict[str, Any]:
        """Collect hellos until ``expect`` leaders said hello or ``seconds`` passed, answer
        every one of them with the directory, and release the port. ``names``: the planned
        nodes (empty where the scheduler names them); a hello from any other is refused.

        ``{"port", "heard": [node names], "silent": connections that were not a leader's,
        "refused": [why, for each hello that was not a planned node's], "seconds"}``.
        """
        began = time.monotonic()
        deadline = began + seconds
        hearing = _Hearing(self.sock, expect, names)
        try:
            while len(hearing.members) < expect:
                now = time.monotonic()
                if now >= deadline:
                    break
                hearing.listen(now, deadline)
        finally:
            hearing.close()
            self.sock.close()
        _send_directory(hearing.members)
        return {"port": self.port,
                "heard": [str(info.get("node")) for _, info in hearing.members],
                "silent": hearing.silent, "refused": hearing.refused,
                "seconds": round(time.monotonic() - began, 4)}


class _Hearing:
    """What node 0 hears on its port: connections that have not sent their first line yet,
    the leaders that said hello (each with its connection, answered at the end), and how many
    connections were not a leader's (closed at once)."""

    def __init__(self, sock: socket.socket, expect: int, names: Sequence[str]) -> None:
        self.sock = sock
        self.expect = expect
        self.names = frozenset(names)
        self.refused: list[str] = []
        self.selector = selectors.DefaultSelector()
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ)
        self.pending: dict[socket.socket, tuple[float, bytearray, str]] = {}
        self.members: list[tuple[socket.socket, dict[str, Any]]] = []
        self.silent = 0

    def listen(self, now: float, deadline: float) -> None:
        """One turn: close connections silent for :data:`FIRST_LINE_S`, then accept and read
        what arrives within 0.1 s."""
        for conn, (opened, _, _) in list(self.pending.items()):
            if now - opened > FIRST_LINE_S:
                self._refuse(conn)
        for key, _ in self.selector.select(min(0.1, deadline - now)):
            if key.fileobj is self.sock:
                self._accept()
            else:
                self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, address = self.sock.accept()
        except OSError:
            return
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ)
        self.pending[conn] = (time.monotonic(), bytearray(), str(address[0]))

    def _read(self, conn: socket.socket) -> None:
        """More of a connection's first line; a whole hello makes it a member."""
        _, buffer, peer = self.pending[conn]
        try:
            chunk = conn.recv(4096)
        except OSError:
            chunk = b""
        buffer += chunk
        if not buffer.startswith(HELLO[: len(buffer)]) or not chunk or len(buffer) > _MAX_LINE:
            self._refuse(conn)
            return
        if b"\n" not in buffer:
            return
        line = bytes(buffer).split(b"\n", 1)[0][len(HELLO):]
        self.selector.unregister(conn)
        self.pending.pop(conn, None)
        try:
            info = json.loads(line.decode("utf-8", "replace"))
        except ValueError:
            info = None
        why = self._not_a_planned_node(info)
        if why is not None:
            self.refused.append(f"{peer}: {why}")
            conn.close()
            return
        assert isinstance(info, dict)
        info["address"] = info.get("address") or peer
        self.members.append((conn, info))

    def _not_a_planned_node(self, info: object) -> str | None:
        """Why a hello is not one of the planned nodes' (None: it is, and is the first)."""
        if not isinstance(info, dict):
            return "not a hello (a JSON object)"
        node, group = info.get("node"), info.get("group_rank")
        if not isinstance(node, str) or not node:
            return "a hello without a node name"
        if self.names and node not in self.names:
            return f"{node!r} is not a node of the plan"
        if group is not None and (isinstance(group, bool) or not isinstance(group, int)
                                  or not 0 <= group < max(self.expect, 1)):
            return f"group rank {group!r} is not one of the plan's"
        for _, member in self.members:
            if member.get("node") == node or (group is not None
                                              and member.get("group_rank") == group):
                return f"{node!r} (group rank {group}) already said hello"
        return None

    def _drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        self.pending.pop(conn, None)
        conn.close()

    def _refuse(self, conn: socket.socket) -> None:
        self.silent += 1
        self._drop(conn)

    def close(self) -> None:
        """Close every connection that never said hello, and stop selecting."""
        for conn in list(self.pending):
            self._drop(conn)
        self.selector.close()


def _send_directory(members: list[tuple[socket.socket, dict[str, Any]]]) -> None:
    """Answer every leader that said hello with the directory and node 0's clock."""
    reply = (json.dumps({"directory": [info for _, info in members], "time": time.time()})
             + "\n").encode()
    for conn, _ in members:
        try:
            conn.setblocking(True)
            conn.settimeout(2.0)
            conn.sendall(reply)
        except OSError:
            pass
        finally:
            conn.close()


def answer(host: str, port: int, hello: dict[str, Any], window_s: float,
           try_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """A leader's side: connect (retrying until the window ends), say hello, wait for the
    directory. Never raises.

    ``{"host", "port", "outcome", "seconds" (of the connection that worked, or the last try),
    "tries", "detail", "directory" (list or None), "clock_offset_s" (None without a reply)}``;
    outcome is ``ok`` once a connection was made, else the last try's (refused, timeout,
    unreachable, error).
    """
    began = time.monotonic()
    deadline = began + window_s
    tries = 0
    while True:
        tries += 1
        attempt = time.monotonic()
        sock, outcome, detail = open_connection(
            host, port, max(0.1, min(try_s, deadline - attempt)))
        seconds = round(time.monotonic() - attempt, 4)
        result: dict[str, Any] = {"host": host, "port": port, "outcome": outcome,
                                  "seconds": seconds, "tries": tries, "detail": detail,
                                  "directory": None, "clock_offset_s": None}
        if sock is not None:
            # Node 0 listened before this connection, so it answers within its window from
            # now: wait that long, whenever this node's own window began.
            return _exchange(sock, hello, time.monotonic() + window_s + 2.0, result)
        if time.monotonic() + RETRY_S >= deadline:
            result["detail"] = (f"{detail}; {tries} tr{'y' if tries == 1 else 'ies'} over "
                                f"{time.monotonic() - began:.1f} s")
            return result
        time.sleep(RETRY_S)


def _exchange(sock: socket.socket, hello: dict[str, Any], deadline: float,
              result: dict[str, Any]) -> dict[str, Any]:
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendall(HELLO + json.dumps(hello).encode() + b"\n")
        data = b""
        while b"\n" not in data and len(data) < (1 << 24):
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        received = time.time()
    except OSError as exc:
        result["detail"] = f"connected, but no directory came back: {exc}"
        return result
    finally:
        sock.close()
    try:
        reply = json.loads(data.split(b"\n", 1)[0].decode("utf-8", "replace"))
        result["directory"] = list(reply["directory"])
        result["clock_offset_s"] = round(received - float(reply["time"]), 4)
    except (ValueError, KeyError, TypeError):
        result["detail"] = ("connected, but what answered is not node 0's roll call (it ended "
                            "before this node said hello, or another program holds the port)")
    return result
