"""Can this node reach that port? Bounded TCP listeners and connectors for the connect tier.

Standard library only, Python 3.8+, no orchestrate imports: the file is shipped to the job's
hosts and run there (``python3 -S reachability.py listen|connect ...``), or imported.

- :class:`Listener` binds at once (so a taken port is an error before anyone connects, and the
  kernel-chosen port is known), then :meth:`Listener.serve` accepts connections for at most
  ``seconds`` and reports who said hello. Every connector sends one line,
  ``orchestrate-connect <name>``, so the report names nodes, not addresses (a node may have
  several).
- :func:`connect` tries one ``host:port`` within ``timeout`` (3 s, the bound of the reference
  notes) and says ``ok``, ``refused`` (nothing listens, or a firewall REJECTs), ``timeout``
  (a firewall DROPs, or the target is down), ``unreachable`` (no route, or the name does not
  resolve) or ``error``. :func:`connect_all` tries many at once, in threads.

Port for the node-to-node test: ``Listener(port=0)``, so the kernel picks it from the ephemeral
range (``net.ipv4.ip_local_port_range``, 32768-60999 by default). That is exactly where gloo's
pair sockets, NCCL's bootstrap and its socket transport listen (they bind port 0), so a
firewall that only opens MASTER_PORT shows up here instead of as a hang in the first
collective; and a kernel-picked port is never one already in use.
"""

from __future__ import annotations

import argparse
import errno
import json
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

HELLO = b"orchestrate-connect "
CONNECT_TIMEOUT_S = 3.0
_READ_HELLO_S = 1.0
_UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def open_connection(
    host: str, port: int, timeout: float = CONNECT_TIMEOUT_S
) -> tuple[socket.socket | None, str, str]:
    """One TCP connection within ``timeout``: ``(socket, "ok", "")``, or ``(None, outcome,
    detail)`` with outcome refused / timeout / unreachable / error. Never raises; the caller
    owns (and closes) the socket."""
    began = time.monotonic()
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return None, "unreachable", f"cannot resolve {host}: {exc}"
    last: tuple[str, str] = ("error", "no address")
    for family, kind, proto, _, address in infos:
        remaining = timeout - (time.monotonic() - began)
        if remaining <= 0:
            return None, "timeout", f"no answer within {timeout:g} s"
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(remaining)
            sock.connect(address)
            return sock, "ok", ""
        except ConnectionRefusedError:
            last = ("refused", "connection refused")
        except (TimeoutError, socket.timeout):  # socket.timeout: Python < 3.10
            sock.close()
            return None, "timeout", f"no answer within {timeout:g} s"
        except OSError as exc:
            if exc.errno in _UNREACHABLE:
                last = ("unreachable", exc.strerror or str(exc))
            else:
                last = ("error", str(exc))
        sock.close()
    return None, last[0], last[1]


def connect(
    host: str, port: int, timeout: float = CONNECT_TIMEOUT_S, hello: str | None = None
) -> dict[str, Any]:
    """Try one TCP connection; never raises. ``{"host", "port", "outcome", "seconds",
    "detail"}``."""
    began = time.monotonic()
    sock, outcome, detail = open_connection(host, port, timeout)
    if sock is not None:
        try:
            if hello is not None:
                sock.settimeout(max(0.1, timeout - (time.monotonic() - began)))
                sock.sendall(HELLO + hello.encode("utf-8", "replace") + b"\n")
        except OSError:
            pass  # connected is what was asked; the listener reports who said hello
        finally:
            sock.close()
    return {"host": host, "port": port, "outcome": outcome,
            "seconds": round(time.monotonic() - began, 4), "detail": detail}


def connect_all(
    targets: Sequence[tuple[str, int]], timeout: float = CONNECT_TIMEOUT_S,
    hello: str | None = None,
) -> list[dict[str, Any]]:
    """:func:`connect` to every ``(host, port)`` at once; done within about ``timeout``."""
    results: list[dict[str, Any] | None] = [None] * len(targets)

    def one(i: int, host: str, port: int) -> None:
        results[i] = connect(host, port, timeout, hello)

    threads = [threading.Thread(target=one, args=(i, h, p), daemon=True)
               for i, (h, p) in enumerate(targets)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 1.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [r if r is not None else {"host": h, "port": p, "outcome": "timeout",
                                     "seconds": timeout, "detail": "connector did not return"}
            for r, (h, p) in zip(results, targets)]


class Listener:
    """A TCP listener bound at construction (raises OSError when the port is taken)."""

    def __init__(self, port: int = 0, host: str = "", backlog: int = 128) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            raise
        self.port = int(self.sock.getsockname()[1])

    def serve(
        self, expect: int, seconds: float, stop: threading.Event | None = None
    ) -> dict[str, Any]:
        """Accept until ``expect`` connectors said hello, ``seconds`` passed or ``stop`` is
        set, then close.

        ``{"port", "heard": [{"name", "address"}], "silent": [addresses that connected but
        said nothing], "seconds"}``.
        """
        began = time.monotonic()
        deadline = began + seconds
        heard: list[dict[str, str]] = []
        silent: list[str] = []
        try:
            while len(heard) < expect:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (stop is not None and stop.is_set()):
                    break
                wait = remaining if stop is None else min(remaining, 0.1)
                ready, _, _ = select.select([self.sock], [], [], wait)
                if not ready:
                    continue
                conn, address = self.sock.accept()
                with conn:
                    name = _read_hello(conn, min(_READ_HELLO_S, max(0.05, remaining)))
                if name is None:
                    silent.append(str(address[0]))
                else:
                    heard.append({"name": name, "address": str(address[0])})
        finally:
            self.close()
        return {"port": self.port, "heard": heard, "silent": silent,
                "seconds": round(time.monotonic() - began, 4)}

    def close(self) -> None:
        self.sock.close()


def _read_hello(conn: socket.socket, timeout: float) -> str | None:
    conn.settimeout(timeout)
    data = b""
    try:
        while b"\n" not in data and len(data) < 512:
            chunk = conn.recv(512)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    line = data.split(b"\n", 1)[0]
    if not line.startswith(HELLO):
        return None
    return line[len(HELLO):].decode("utf-8", "replace").strip()


def _target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """``listen`` prints ``{"listening": PORT}`` (or ``{"error": ...}``) at once, then the
    report; ``connect`` prints one result per target. Each a JSON line."""
    parser = argparse.ArgumentParser(prog="reachability.py")
    sub = parser.add_subparsers(dest="command", required=True)
    listen = sub.add_parser("listen")
    listen.add_argument("--host", default="")
    listen.add_argument("--port", type=int, default=0)
    listen.add_argument("--expect", type=int, default=1)
    listen.add_argument("--seconds", type=float, default=10.0)
    conn = sub.add_parser("connect")
    conn.add_argument("--hello", default=None)
    conn.add_argument("--timeout", type=float, default=CONNECT_TIMEOUT_S)
    conn.add_argument("targets", nargs="+", help="HOST:PORT")
    args = parser.parse_args(argv)
    if args.command == "listen":
        try:
            listener = Listener(args.port, args.host)
        except OSError as exc:
            print(json.dumps({"error": str(exc), "port": args.port}), flush=True)
            return 1
        print(json.dumps({"listening": listener.port}), flush=True)
        print(json.dumps(listener.serve(args.expect, args.seconds)), flush=True)
        return 0
    results = connect_all([_target(t) for t in args.targets], args.timeout, args.hello)
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(r["outcome"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
