"""One pty channel per rank, speaking to the agent, and the rank handle built on it.

Every rank gets its own SSH session with a pty, running ``python -c <agent> serve``. Local rank
0's channel first does the host's preflight, lease claim and file copy; then every channel is
told ``start`` and its agent runs ``bash <run_dir>/launch-<node>.sh LOCAL_RANK`` on the pty.
Why a pty: when the channel closes (the controller died or stopped the job) the remote session
gets SIGHUP, and the agent then stops the job's processes on that host by tag.

Output arrives in chunks, not lines: a reader thread per channel keeps the partial line (at
most :data:`~orchestrate.hostside.outputlog.LINE_MAX` bytes: a longer one goes on in pieces of
that size), tells protocol lines (``<RS>orchestrate:<kind> <json>``) from rank output, and hands
the rank's output to the log sink as it came, byte for byte (the agent set the pty raw: no
``\\r`` is added, nothing is echoed). Secrets go to the rank's stdin right after its pid is
known.
"""

from __future__ import annotations

import contextlib
import json
import queue
import shlex
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orchestrate.backends.ssh.agent
import orchestrate.backends.ssh.facts
import orchestrate.backends.ssh.hostcheck
import orchestrate.backends.ssh.wire
import orchestrate.core.exits
import orchestrate.core.layout
import orchestrate.core.plan.outcome
import orchestrate.core.plan.restart
import orchestrate.hostside.bookdir
import orchestrate.hostside.containment
import orchestrate.hostside.fairshare
import orchestrate.hostside.gpuhealth
import orchestrate.hostside.gpuuse
import orchestrate.hostside.host
import orchestrate.hostside.leaserecord
import orchestrate.hostside.leases
import orchestrate.hostside.masterreach
import orchestrate.hostside.queueview
import orchestrate.hostside.safeplace
import orchestrate.hostside.smi
import orchestrate.hostside.smicsv
import orchestrate.hostside.watchdog
from orchestrate.backends.ssh.agent import MARK
from orchestrate.backends.ssh.connections import Link, SshChannel
from orchestrate.backends.ssh.wire import End, Ended, Exited, ForeignUse, Pid, Record
from orchestrate.core.exits import EXIT_LOST
from orchestrate.core.plan.outcome import Exit
from orchestrate.hostside.outputlog import LINE_MAX
from orchestrate.hostside.shipping import Manifest, compact, program

#: A rank whose channel ends without the agent saying how it ended (connection lost, agent
#: killed) is reported with ssh's own status for that.
LOST = EXIT_LOST
_MARK = MARK.encode()



#: The SSH agent, one per host and job: the host's own mechanisms (kill-by-tag, containment,
#: the lease book and what it reads, the watchdog's stop), the run rules, then the protocol.
AGENT = Manifest("agent", (
    orchestrate.hostside.host, orchestrate.hostside.containment, orchestrate.hostside.smicsv,
    orchestrate.hostside.smi, orchestrate.hostside.gpuuse, orchestrate.hostside.gpuhealth,
    orchestrate.hostside.bookdir,
    orchestrate.hostside.leaserecord, orchestrate.hostside.fairshare, orchestrate.hostside.leases,
    orchestrate.hostside.queueview,
    orchestrate.hostside.watchdog, orchestrate.hostside.safeplace, orchestrate.hostside.masterreach,
    orchestrate.core.exits, orchestrate.core.layout, orchestrate.core.plan.outcome,
    orchestrate.core.plan.restart, orchestrate.backends.ssh.wire, orchestrate.backends.ssh.facts,
    orchestrate.backends.ssh.hostcheck, orchestrate.backends.ssh.agent))


def agent_source() -> str:
    """The agent program's text: the host module, then the agent's protocol."""
    return program(AGENT, "from orchestrate.backends.ssh.agent import main\n"
                          "sys.exit(main(sys.argv[1:], sys.stdout))")


def agent_command(python: str, *args: str) -> str:
    """The remote command line that runs the agent under ``python``.

    ``-S`` skips ``site`` (the agent needs only the standard library): a third of the
    interpreter's start-up, paid once per rank and host. The text goes compacted: whole, it is
    more than one argument may hold (:func:`orchestrate.hostside.shipping.compact`).
    """
    words = [python, "-S", "-c", compact(agent_source()), *args]
    return "exec " + " ".join(shlex.quote(w) for w in words)


class ChannelError(Exception):
    """The agent did not answer as expected; the message says what it said instead."""


class AgentChannel:
    """A pty session running the agent; requests in, replies and rank output out."""

    def __init__(self, link: Link, python: str, secrets: list[str] | None = None) -> None:
        self.link = link
        self.python = python
        self.secrets = secrets or []
        self._replies: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._lock = threading.Lock()
        self._emit: Callable[[bytes], None] | None = None
        self._pending: list[bytes] = []
        self.preamble: deque[str] = deque(maxlen=20)  # login noise, errors before the agent
        self.started = False
        self.is_ready = False
        self.pid: int | None = None
        self.exit: Exit | None = None
        self.left: int | None = None  # processes of the job still on the host when it ended
        self.ended = threading.Event()
        self.spoke = threading.Event()  # the rank's first output came
        #: Told what the agent sees of other users on the job's GPUs (pid -> line), if set.
        self.on_foreign: Callable[[dict[int, str]], None] | None = None
        self.channel: SshChannel = link.session()
        self.channel.get_pty(term="dumb", width=250, height=50)
        self.channel.exec_command(agent_command(python, "serve"))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # ---------------------------------------------------------------- reading

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.channel.recv(65536)
            except Exception:  # a closed transport raises instead of returning b""
                data = b""
            if not data:
                break
            buffer += data
            start = 0
            while (nl := buffer.find(b"\n", start)) >= 0:
                self._line(buffer[start:nl + 1])
                start = nl + 1
            while len(buffer) - start > LINE_MAX:  # a long line goes on in pieces
                end = start + LINE_MAX
                mark = buffer.rfind(_MARK[:1], end - len(_MARK), end)
                end = mark if mark > start else end  # never cut a protocol line in two
                self._output(buffer[start:end])
                start = end
            buffer = buffer[start:]
        if buffer:
            self._line(buffer)
        if self.exit is None:
            self.exit = Exit(code=self._channel_status())
        self.ended.set()
        self._replies.put(("eof", {}))

    def _channel_status(self) -> int:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not self.channel.exit_status_ready():
            time.sleep(0.02)
        if self.channel.exit_status_ready():
            status = self.channel.recv_exit_status()
            if status >= 0:
                return status
        return LOST

    def _line(self, raw: bytes) -> None:
        """One line (with its newline, unless the channel ended first): protocol or output."""
        at = raw.find(_MARK)
        if at < 0:
            self._output(raw)
            return
        if at > 0:
            self._output(raw[:at])
        text = raw[at + len(_MARK):].decode("utf-8", errors="replace").rstrip("\r\n")
        kind, _, payload = text.partition(" ")
        try:
            data: dict[str, Any] = json.loads(payload) if payload else {}
        except ValueError:
            self._output(raw[at:])
            return
        if kind == "pid":
            self.pid = Pid.from_json(data).pid
            if self.secrets:
                # If the rank is gone already, its exit says why.
                with contextlib.suppress(Exception):
                    self.channel.sendall("".join(v + "\n" for v in self.secrets).encode())
        elif kind == "exit":
            exited = Exited.from_json(data)
            self.left = exited.left
            self.exit = Exit(code=exited.code, signal=exited.signal)
        elif kind == "foreign":
            if self.on_foreign is not None:
                with contextlib.suppress(Exception):  # a bad report never stops the reader
                    uses = ForeignUse.from_json(data).uses
                    self.on_foreign({int(pid): str(line) for pid, line in uses.items()})
            return
        self._replies.put((kind, data))

    def _output(self, raw: bytes) -> None:
        with self._lock:
            if not self.started:
                self.preamble.append(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
                return
            self.spoke.set()
            if self._emit is None:
                self._pending.append(raw)
            else:
                self._emit(raw)

    def attach(self, emit: Callable[[bytes], None]) -> None:
        """Send rank output to ``emit`` from now on (lines that came earlier first)."""
        with self._lock:
            for text in self._pending:
                emit(text)
            self._pending.clear()
            self._emit = emit

    # ---------------------------------------------------------------- requests

    def send(self, request: Record) -> None:
        """One request line to the agent (:mod:`.wire`)."""
        self.channel.sendall((json.dumps(request.to_json()) + "\n").encode())

    def reply(self, kind: str, timeout: float) -> dict[str, Any]:
        """Wait for the agent's answer of ``kind``; :class:`ChannelError` if it says or does
        anything else (an error, the end of the channel) or nothing within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelError(f"no answer ({kind}) within {timeout:g}s")
            try:
                got, data = self._replies.get(timeout=remaining)
            except queue.Empty:
                continue
            if got == kind:
                return data
            if got == "error":
                raise ChannelError(str(data.get("detail")))
            if got == "eof":
                self._replies.put((got, data))  # later waits see the end too
                raise ChannelError(self.describe_end())

    def ready(self, timeout: float) -> None:
        """Wait until the agent runs and has set the pty raw (once; later calls return)."""
        if not self.is_ready:
            self.reply("ready", timeout)
            self.is_ready = True

    def request(self, request: Record, kind: str, timeout: float) -> dict[str, Any]:
        """Send a request and wait for its answer."""
        self.send(request)
        return self.reply(kind, timeout)

    def describe_end(self) -> str:
        """Why the channel ended before the agent answered, with what the host printed."""
        status = self.exit.describe() if self.exit is not None else "no status"
        said = " | ".join(line for line in self.preamble if line.strip())[-400:]
        if self.exit is not None and self.exit.code == 127:
            return f"{self.python} not found on the host ({said or status})"
        return f"the remote side ended ({status})" + (f": {said}" if said else "")

    def start(self, request: Record) -> None:
        """Ask the agent to start the rank; output from now on is the rank's."""
        with self._lock:
            self.started = True
        self.send(request)

    def close(self) -> None:
        """Close the channel: the remote session gets SIGHUP."""
        self.channel.close()


class SSHRank:
    """A rank on a remote host (:class:`~orchestrate.run.supervise.RankHandle`)."""

    def __init__(
        self,
        rank: int,
        node: str,
        channel: AgentChannel,
        start_request: Record,
        stop_host: Callable[[bool], None],
        start_timeout_s: float = 60.0,
    ) -> None:
        self.rank = rank
        self.node = node
        self.channel = channel
        self.start_request = start_request
        self.stop_host = stop_host
        self.start_timeout_s = start_timeout_s
        self.primed = False
        self.forced_at: float | None = None
        #: Why and when the rank's host was lost (its SSH connection died), if it was.
        self.lost: str | None = None

    def prime(self) -> None:
        """Send the start request now (ranks start in parallel; :meth:`start` then waits)."""
        if not self.primed:
            self.primed = True
            with contextlib.suppress(Exception):  # a dead channel: poll() reports its end
                self.channel.start(self.start_request)

    def start(self, emit: Callable[[bytes], None]) -> int | None:
        """Attach the log, start the rank if not yet, and return its remote pid."""
        self.channel.attach(emit)
        self.prime()
        try:
            self.channel.reply("pid", self.start_timeout_s)
        except ChannelError as exc:
            emit(f"orchestrate: rank did not start on {self.node}: {exc}\n".encode())
            self.channel.close()
            return None
        return self.channel.pid

    def poll(self) -> Exit | None:
        """How the rank ended, once its agent said so or its channel closed; a rank whose
        host's connection died ended then (:attr:`lost` says so), whatever it may still do."""
        ended = self.channel.exit
        if ended is not None and ended.code != LOST:
            return ended
        if not self.channel.link.alive():
            self.lost = self.channel.link.lost
            return Exit(code=LOST)
        if ended is not None:
            return ended
        if self.forced_at is not None and time.monotonic() - self.forced_at > 10:
            # Forced, channel closed, and still nothing: the host is gone. Never wait for ever.
            return Exit(code=LOST)
        return None

    def exit_fd(self) -> int | None:
        """None: a remote rank's end comes over its channel, seen at the loop's pace."""
        return None

    def finish(self, grace_s: float, timeout: float) -> list[str]:
        """The job is over: the agent stops what the rank left below it and leaves the lease;
        what outlived SIGKILL there, named (nothing when the agent is gone already)."""
        if self.channel.ended.is_set():
            return []
        try:
            reply = Ended.from_json(self.channel.request(End(grace_s=grace_s), "ended", timeout))
        except (ChannelError, OSError, EOFError):
            return []
        except Exception:  # a transport that died meanwhile: the hangup sweeps there
            return []
        return [str(s) for s in reply.survivors]

    @property
    def left_host_clean(self) -> bool:
        """Whether the agent saw no process of the job left on the host when this rank ended
        (then nothing of it can be there any more: nothing was left to start one)."""
        return self.channel.left == 0

    def stop(self, force: bool) -> None:
        """SIGTERM (then SIGKILL) the job's processes on this rank's host, by tag; when
        ``force``, also close the channel so the remote session gets SIGHUP."""
        self.stop_host(force)
        if force:
            if self.forced_at is None:
                self.forced_at = time.monotonic()
            self.channel.close()
