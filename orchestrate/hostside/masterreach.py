"""Whether this host can reach the job's master before the job starts: MASTER_ADDR resolves
here, and a TCP connection to MASTER_ADDR:MASTER_PORT is answered.

Without this check a job whose nodes cannot resolve or reach MASTER_ADDR (an ssh_config alias
written as a node name, a firewall) passes every other check and its ranks wait in the
rendezvous until its timeout (10 minutes by default). Nothing listens on the master port
before rank 0 starts its store, so rank 0's node holds a :class:`ProbeListener` on that port for
the moment of the check, and closes it before any rank starts: the same agent channel carries
``unlisten`` and, later, ``start``, in that order, so the probe can never hold the port when
the real store binds it. The probing side closes first, so no TIME_WAIT stays on the master
port (and the listener sets SO_REUSEADDR, as torch's store does).

Standard library only, Python 3.8+: it runs inside the SSH agent on every host.
"""

from __future__ import annotations

import socket
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: How long a node waits for the master's port to answer (the probe listener is up already).
REACH_TIMEOUT_S = 5.0


def resolve(address: str) -> dict[str, Any]:
    """``{"ok": True, "addresses": [...]}`` or ``{"ok": False, "detail": why}``."""
    try:
        infos = socket.getaddrinfo(address, None, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return {"ok": False, "detail": f"MASTER_ADDR {address} does not resolve here: {reason}"}
    found = []
    for info in infos:
        ip = str(info[4][0])
        if ip not in found:
            found.append(ip)
    return {"ok": True, "addresses": found}


class ProbeListener:
    """A listener on the master port that accepts, waits for the peer to close, and closes."""

    def __init__(self, port: int) -> None:
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", port), family=socket.AF_INET6,
                                             dualstack_ipv6=True, reuse_port=False)
        else:
            self.sock = socket.create_server(("", port))
        self.sock.settimeout(0.2)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=_drain, args=(conn,), daemon=True).start()

    def close(self) -> None:
        """Stop listening (before any rank starts)."""
        self.closed.set()
        self.sock.close()
        self.thread.join(timeout=2.0)


def _drain(conn: socket.socket) -> None:
    """Wait for the prober to close its end first, then close ours (no TIME_WAIT here)."""
    conn.settimeout(REACH_TIMEOUT_S * 2)
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    finally:
        conn.close()


def listen(port: int) -> tuple[ProbeListener | None, dict[str, Any]]:
    """A probe listener on ``port``, and the answer for the controller."""
    try:
        return ProbeListener(port), {"ok": True}
    except OSError as exc:
        return None, {"ok": False,
                      "detail": f"cannot listen on master port {port}: {exc.strerror or exc}"}


def reach(address: str, port: int, timeout: float = REACH_TIMEOUT_S) -> dict[str, Any]:
    """Connect to ``address:port`` and close (this side first): ``{"ok": True, "via": ip}``
    or ``{"ok": False, "detail": why}``, in words a user can act on."""
    resolved = resolve(address)
    if not resolved["ok"]:
        return resolved
    try:
        conn = socket.create_connection((address, port), timeout=timeout)
    except socket.timeout:
        return {"ok": False, "detail": f"no answer from MASTER_ADDR {address} port {port} "
                                       f"within {timeout:g}s (a firewall, or the wrong address)"}
    except OSError as exc:
        return {"ok": False, "detail": f"cannot connect to MASTER_ADDR {address} port {port}: "
                                       f"{exc.strerror or exc}"}
    try:
        via = str(conn.getpeername()[0])
    except OSError:
        via = address
    conn.close()
    return {"ok": True, "via": via}
