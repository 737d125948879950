"""Who answers: host keys checked on the target and on every jump host, and what a failed
open means to a user.

Split from :mod:`.connections` because the checks must hold on every hop of a connection, not
only its last one. Fabric builds the ``ProxyJump`` gateways of an ssh_config itself, each with
paramiko's ``AutoAddPolicy``: a bastion whose key is unknown or changed would be accepted
silently while OpenSSH refuses the same config. :func:`verify_chain` gives each gateway the
target's known_hosts files and policy (and its timeouts and identity), and
:func:`open_verified` opens the gateways first, innermost first, so a refusal names the hop it
is about ("jump host 198.18.8.11:22 (ProxyJump towards h2)") in the same words as a target's.

Paramiko and Fabric have no type hints: everything here takes and returns ``Any`` for them.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Protocol


class KeyRules(Protocol):
    """What these checks read of a :class:`~.connections.Target` (declared here: that module
    imports this one)."""

    @property
    def known_hosts_file(self) -> str | None: ...
    @property
    def accept_unknown_host_keys(self) -> bool: ...
    @property
    def identity_file(self) -> str | None: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def label(self) -> str: ...


class ConnectError(Exception):
    """A host could not be reached or logged into; ``check`` says which step failed."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(detail)
        self.check = check
        self.detail = detail


def known_hosts(target: KeyRules, ssh_config: Any) -> list[str]:
    """The known_hosts files to check ``target`` (or a jump host towards it) against: the
    inventory's, else ssh_config's User/GlobalKnownHostsFile, else OpenSSH's defaults."""
    if target.known_hosts_file:
        return [os.path.expanduser(target.known_hosts_file)]
    files: list[str] = []
    for key in ("userknownhostsfile", "globalknownhostsfile"):
        value = ssh_config.get(key)
        if value:
            files.extend(os.path.expanduser(v) for v in str(value).split())
    if "userknownhostsfile" not in ssh_config:
        files.insert(0, os.path.expanduser("~/.ssh/known_hosts"))
    if "globalknownhostsfile" not in ssh_config:
        files.append("/etc/ssh/ssh_known_hosts")
    return files


def _accept_unknown_policy() -> Any:
    import paramiko

    class AcceptUnknown(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]
        """Trust a key seen for the first time, for this connection only (never saved)."""

        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            return None

    return AcceptUnknown()


def gateways(conn: Any) -> list[Any]:
    """The ``ProxyJump`` Connections ``conn`` goes through, the one opened first first (a
    ``ProxyCommand`` string is not one: OpenSSH's own command checks its host)."""
    hops: list[Any] = []
    hop = getattr(conn, "gateway", None)
    while hop is not None and not isinstance(hop, (str, bool)):
        hops.append(hop)
        hop = getattr(hop, "gateway", None)
    return list(reversed(hops))


def _check_keys(conn: Any, t: KeyRules) -> tuple[list[str], list[str]]:
    """Load the known_hosts files into ``conn``'s client and set the policy; (found, wanted)."""
    import paramiko

    wanted = known_hosts(t, conn.ssh_config)
    found = [path for path in wanted if os.path.isfile(path)]
    for path in found:
        conn.client.load_host_keys(path)
    conn.client.set_missing_host_key_policy(
        _accept_unknown_policy() if t.accept_unknown_host_keys else paramiko.RejectPolicy())
    return found, wanted


def verify_chain(conn: Any, t: KeyRules, kwargs: dict[str, Any]) -> None:
    """Give every jump host of ``conn`` the target's host-key rules, timeouts and identity
    (Fabric made them with AutoAddPolicy and its defaults)."""
    for hop in gateways(conn):
        hop.connect_timeout = conn.connect_timeout
        hop.connect_kwargs.update(kwargs)
        if t.identity_file:
            others = list(hop.connect_kwargs.get("key_filename", []))
            hop.connect_kwargs["key_filename"] = [os.path.expanduser(t.identity_file), *others]
        if str(hop.ssh_config.get("identitiesonly", "no")).lower() == "yes":
            hop.connect_kwargs["look_for_keys"] = False


def open_verified(conn: Any, t: KeyRules) -> None:
    """Open ``conn`` and its jump hosts (innermost first), host keys checked on each; whatever
    fails is a :class:`ConnectError` naming the hop and the step."""
    for hop in gateways(conn):
        _open_one(hop, t, f"jump host {hop.host}:{hop.port} (ProxyJump towards {t.label})")
    _open_one(conn, t, f"{conn.host}:{conn.port}")


def _open_one(conn: Any, t: KeyRules, where: str) -> None:
    found, wanted = _check_keys(conn, t)
    started = time.monotonic()
    try:
        conn.open()
    except Exception as exc:
        transport = conn.client.get_transport()
        spoke = transport is None or bool(getattr(transport, "remote_version", ""))
        conn.client.close()
        refused = (_silent(where, t.connect_timeout_s, time.monotonic() - started)
                   if not spoke else None) or refusal(exc, where, conn, t.connect_timeout_s,
                                                      found, wanted)
        if refused is None:
            raise
        raise refused from None


def _silent(where: str, timeout: float, waited: float) -> ConnectError:
    """A TCP connection was made, and no SSH version line came back."""
    if waited >= 0.8 * timeout:
        return ConnectError("ssh", f"{where} accepted TCP, no SSH banner within {timeout:g} s "
                                   "(is sshd running there, and is this its port?)")
    return ConnectError("ssh", f"{where} accepted TCP but does not speak SSH (no SSH banner: "
                               "another service on this port?)")


def refusal(exc: Exception, where: str, conn: Any, timeout: float, known: list[str],
            wanted: list[str]) -> ConnectError | None:
    """What a failed open means to a user, by the step that failed; None for an error that is
    not about reaching or logging in (a bug: let it through)."""
    import paramiko

    if isinstance(exc, paramiko.BadHostKeyException):
        return ConnectError(
            "host key",
            f"host key of {where} does NOT match known_hosts ({', '.join(known)}): "
            "refused (a changed key can mean another machine answers at this address)")
    if isinstance(exc, paramiko.PasswordRequiredException):
        return ConnectError("login", "the identity file needs a passphrase: load the key "
                                     "into ssh-agent (orchestrate never asks)")
    if isinstance(exc, paramiko.AuthenticationException):
        return ConnectError(
            "login", f"authentication as {conn.user} failed ({exc}); "
            "orchestrate uses keys and the agent, no passwords")
    if isinstance(exc, paramiko.SSHException):
        return _handshake_refusal(exc, where, conn, known, wanted)
    if isinstance(exc, socket.gaierror):
        return ConnectError("ssh", f"unknown host {conn.host!r}: {exc}")
    if isinstance(exc, TimeoutError):
        return ConnectError("ssh", f"unreachable: no answer from {where} within {timeout:g}s")
    if isinstance(exc, OSError):
        inner = getattr(exc, "errors", None)  # paramiko's NoValidConnectionsError
        causes = list(inner.values()) if isinstance(inner, dict) else [exc]
        reason = "; ".join(sorted({c.strerror or str(c) for c in causes}))
        return ConnectError("ssh", f"unreachable: {where}: {reason}")
    return None


def _looked(known: list[str], wanted: list[str]) -> str:
    """The known_hosts files that were read, each once."""
    read = list(dict.fromkeys(known))
    return ", ".join(read) or f"any known_hosts file (none of {', '.join(dict.fromkeys(wanted))})"


def _keyscan(conn: Any, wanted: list[str]) -> str:
    """The line that adds the host's key: into the first known_hosts file that is not
    /dev/null (ssh_config often points one there), else ~/.ssh/known_hosts."""
    into = next((f for f in wanted if f != os.devnull), "~/.ssh/known_hosts")
    port = "" if int(conn.port or 22) == 22 else f"-p {conn.port} "
    return (f"check its fingerprint, then add it: ssh-keyscan {port}{conn.host} >> {into} "
            "(or set ssh.accept_unknown_host_keys: true in the inventory)")


def _handshake_refusal(exc: Exception, where: str, conn: Any, known: list[str],
                       wanted: list[str]) -> ConnectError:
    """An SSH-level failure: an unknown host key, a login refused, or the handshake itself."""
    if "known_hosts" in str(exc):
        return ConnectError("host key", f"unknown host key for {where}: not in "
                                        f"{_looked(known, wanted)}; {_keyscan(conn, wanted)}")
    if "authentication" in str(exc).lower():
        return ConnectError(
            "login", f"cannot log in to {where} as {conn.user}: {exc} (give "
            "ssh.identity_file, an IdentityFile in ssh_config, or load ssh-agent)")
    return ConnectError("ssh", f"ssh handshake with {where} failed: {exc}")
