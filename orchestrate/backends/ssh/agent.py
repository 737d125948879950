"""The program orchestrate runs on every SSH host, sent as ``python -c SOURCE MODE [ARGS]``.

Standard library only, Python 3.8+: it runs under the node's interpreter (inventory ``python``),
before anything of ours is installed there. Its modes:

``serve`` runs on a pty channel, one per rank. It becomes a child subreaper (whatever its rank
starts stays below it, :mod:`orchestrate.hostside.containment`), sets the pty raw (no echo:
secrets written to stdin never come back in the output; no line editing or signal characters),
says ``ready``, then obeys one JSON request per stdin line, answering each on stdout as a line
``<RS>orchestrate:<kind> <json>``:

- ``preflight``: every check of this host in one go (python, torch, workdir, master port,
  whether MASTER_ADDR resolves here, network interface towards MASTER_ADDR, GPUs by
  nvidia-smi and which of them processes outside orchestrate use, the leases other jobs hold
  and the jobs queued before this one: :mod:`.hostcheck`), answered as one
  :class:`~orchestrate.backends.ssh.facts.HostFacts`;
- ``claim``: record this job's GPUs and port in the host's shared lease book
  (:mod:`orchestrate.hostside.leases`), under flock, unless another live job holds them or an
  older waiting job wants them (then say which; a waiting job's ticket stays queued), and make
  the job's cgroup where one can be made;
- ``queue``: a waiting job's ticket in the host's queue (held by this agent), its claim dropped;
- ``listen``, ``reach``, ``unlisten``: the check that every node reaches MASTER_ADDR's port
  before launch (rank 0's node holds a probe listener on the port meanwhile,
  :mod:`orchestrate.hostside.masterreach`);
- ``progress``: how far training got here
  (:func:`~orchestrate.core.plan.restart.progress_marker`), asked on rank 0's channel before
  the first attempt starts (the mode of the same name below costs a shell and an interpreter);
- ``files``: write the run directory's files (0700 directory, 0600/0700 files), through its
  checked folder (:mod:`orchestrate.hostside.safeplace`: an unsafe place is refused, named);
- ``start``: join the job's lease as a holder (and its cgroup), check the whole path of the
  script again (:func:`checked`), run ``bash launch-<node>.sh LOCAL_RANK`` as a child that
  inherits the pty, say its pid, wait for it and say how it ended
  and what of the job is left here; meanwhile (``watch_s``, the node's first rank) say other
  users' processes on the job's GPUs here whenever they change (``foreign``);
- ``end``: the job is over: stop what the rank left below this agent, leave the lease (dropped
  once nothing of the job lives), name the survivors, exit the way the rank did;
- ``abort``: release the claim and exit; nothing was started.

The serving process stays the session leader of the pty. When the channel closes (the
controller died, or stopped the job) it gets SIGHUP and stops every process of the job on this
host by tag, and what is below it, before it exits, so nothing outlives a vanished controller.

``reap JOB_ID GRACE_S [LEASE_DIR]`` runs without a pty: SIGTERM (+SIGCONT) to every process whose
environment carries ``ORCHESTRATE_JOB_ID=JOB_ID`` and to the job's cgroup, SIGKILL to what is
left after GRACE_S, then it leaves the job's lease on this host and prints one JSON line.
``gpus [LEASE_DIR]`` prints this host's GPUs and who holds them (``orchestrate gpus``);
``queue [LEASE_DIR]`` this host's fair-share queue (``orchestrate queue --inventory``).

Processes are found, and leases kept, by the host-side modules of
:mod:`orchestrate.hostside`, the same code the local backend runs in-process: this program is
their text followed by this one's (:data:`orchestrate.backends.ssh.channels.AGENT`), so local and
SSH jobs on one machine, of every user, see each other's leases.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from orchestrate.backends.ssh.facts import ClaimAnswer
from orchestrate.backends.ssh.hostcheck import preflight
from orchestrate.backends.ssh.wire import (
    Abort,
    Claim,
    End,
    Ended,
    Exited,
    Files,
    ForeignUse,
    Listen,
    Pid,
    Preflight,
    Queue,
    Reach,
    Ready,
    Record,
    Start,
    StepAnswer,
    TrainingProgress,
    Unlisten,
    WireError,
    read_request,
)
from orchestrate.core.layout import SIDECAR_DIR
from orchestrate.core.plan.restart import progress_marker
from orchestrate.hostside.containment import (
    JobGroup,
    become_subreaper,
    descendants,
    describe_pid,
    reap_orphans,
    stop_processes,
)
from orchestrate.hostside.gpuhealth import gather as gather_health
from orchestrate.hostside.gpuuse import told, usage
from orchestrate.hostside.host import (
    TAG,
    job_pids,
    proc_start,
    reap,
    suppress,
)
from orchestrate.hostside.leaserecord import Ticket
from orchestrate.hostside.leases import (
    BookError,
    LeaseBook,
    machine_gpus,
    new_lease,
)
from orchestrate.hostside.masterreach import ProbeListener, listen, reach
from orchestrate.hostside.queueview import machine_queue
from orchestrate.hostside.safeplace import UnsafePlace, refusal, runnable, write_tree
from orchestrate.hostside.watchdog import stop_job

TYPE_CHECKING = False  # typing costs a few ms per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import IO, Any

MARK = "\x1eorchestrate:"
SAYING = threading.Lock()  # the rank's watcher speaks while the main thread waits


def say(kind: str, payload: Any) -> None:
    """One protocol line on stdout (all of it, even on a slow pty); a reply record is sent as
    its JSON object."""
    if isinstance(payload, Record):
        payload = payload.to_json()
    data = (MARK + kind + " " + json.dumps(payload) + "\n").encode()
    with SAYING:
        while data:
            written = os.write(1, data)
            data = data[written:]


class Requests:
    """Request lines from stdin, read in chunks; the controller never sends ahead of a reply,
    so nothing after a request line (the secrets after ``start``) is ever swallowed."""

    def __init__(self) -> None:
        self.buffer = b""

    def next(self) -> Any:
        """The next request line, decoded (None at the end of stdin)."""
        while b"\n" not in self.buffer:
            try:
                chunk = os.read(0, 65536)
            except OSError:
                return None
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line.decode())


class Serving:
    """State of one serve channel."""

    def __init__(self) -> None:
        self.job_id = ""
        self.claimed = False
        self.joined = False  # a holder of the job's lease on this host
        self.grace_s = 5.0
        self.lease_dir: str | None = None
        self.group: JobGroup | None = None
        self.code = 0  # how the rank ended
        self.probe: ProbeListener | None = None  # on the master port, only during the check

    def master(self, request: Record) -> dict[str, Any]:
        """The check that every node reaches the master before launch (rank 0's node listens
        on the master port, the others connect, rank 0's node stops listening), with
        :mod:`orchestrate.hostside.masterreach`."""
        if isinstance(request, Reach):
            return reach(request.master_addr, request.port)
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        if not isinstance(request, Listen):
            return {"ok": True}
        self.probe, answer = listen(request.port)
        return answer

    def book(self) -> LeaseBook:
        return LeaseBook(self.lease_dir)

    def claim(self, request: Claim) -> ClaimAnswer:
        self.job_id = request.job_id
        self.lease_dir = request.lease_dir
        group = JobGroup.make(f"{socket.gethostname()}.{os.geteuid()}.{self.job_id}")
        lease = new_lease(self.job_id, request.node, request.gpus, request.slots, request.port,
                          [os.getpid()], group.path if group else None
                          ).ending(request.ends_within_s)
        asked = request.ticket
        ticket = None if asked is None else \
            Ticket.from_dict(asked).with_holder(os.getpid(), proc_start(os.getpid()))
        answer = ClaimAnswer.from_json(self.book().claim(
            lease, slot_capacity=request.slot_capacity, ticket=ticket))
        self.claimed = self.joined = answer.ok
        return answer

    def queue(self, request: Queue) -> StepAnswer:
        """Keep this waiting job's place in the host's queue (its ticket, held by this agent);
        drop a claim it made meanwhile."""
        self.job_id = request.job_id
        self.lease_dir = request.lease_dir
        book = self.book()
        with book.locked():
            book.enqueue(Ticket.from_dict(request.ticket).with_holder(
                os.getpid(), proc_start(os.getpid())))
            if self.claimed:
                book.forget_lease(self.job_id)
                self.claimed = self.joined = False
        return StepAnswer(ok=True)

    def unclaim(self) -> None:
        """Nothing started: drop the claim (and the ticket)."""
        if self.claimed or self.job_id:
            with suppress(OSError, BookError):
                self.book().release(self.job_id)
            self.claimed = self.joined = False

    def finish(self) -> list[str]:
        """The job is over here: stop what this agent's rank left below it (orphans re-parent
        to it), leave the lease; the survivors, named."""
        me = os.getpid()
        survivors = stop_processes(lambda: descendants(me), self.grace_s)
        reap_orphans()
        named = [describe_pid(p) for p in survivors]
        if self.group is not None:  # first: a cgroup with this agent in it holds the lease
            self.group.leave()
            self.group.remove()
        if self.joined:
            with suppress(OSError, BookError):
                self.book().leave(self.job_id, [me], survivors,
                                  [f"{name} outlived the job" for name in named])
            self.joined = False
        return named

    def files(self, request: Files) -> StepAnswer:
        """The run directory's files, written through its checked folder's descriptor: every
        folder above it safe, it the user's own 0700 folder (:mod:`~orchestrate.hostside.
        safeplace`); an unsafe place is named with its owner, mode and fix."""
        os.umask(0o077)
        try:
            write_tree(request.run_dir, request.files)
        except UnsafePlace as exc:
            return StepAnswer.from_json(refusal(exc))
        except OSError as exc:
            return StepAnswer(ok=False, detail=f"{exc.strerror}: {exc.filename}")
        return StepAnswer(ok=True)

    def hangup(self, signum: int, _frame: object) -> None:
        """The channel closed under us: stop the job's processes here, then go."""
        with suppress(Exception):
            if self.job_id:
                reap(self.job_id, self.grace_s)
                self.finish()
            if self.claimed and not self.joined:
                self.unclaim()
        os._exit(128 + signum)

    def start(self, request: Start) -> int:
        script = checked(request.script)  # before anything: a refused script starts nothing
        self.job_id = request.job_id
        self.grace_s = float(request.grace_s)
        self.lease_dir = request.lease_dir or self.lease_dir
        if not self.joined:  # every agent of the job here holds its lease while it lives
            with suppress(OSError, BookError):
                self.book().join(self.job_id, os.getpid())
                self.joined = True
        lease = None
        with suppress(OSError, BookError):
            lease = self.book().own(self.job_id)
        if lease is not None and lease.cgroup:  # the claim made one: every rank here is born in it
            self.group = JobGroup.make(f"{socket.gethostname()}.{os.geteuid()}.{self.job_id}")
            if self.group is not None and not self.group.join():
                self.group = None
        # Tagged from its first instruction: the script exports the tag too, but /proc/*/environ
        # shows the environment a process was exec'd with, so kill-by-tag would otherwise miss
        # the script until it execs the rank.
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in request.env.items()})
        env[TAG] = self.job_id
        local_rank = request.local_rank  # None: a node's one process (per_node)
        argument = [] if local_rank is None else [str(local_rank)]
        child = subprocess.Popen(["bash", script, *argument], cwd=os.path.dirname(script),
                                 env=env)
        say("pid", Pid(child.pid))
        done = threading.Event()
        if request.watch_s and lease is not None and lease.gpus:
            threading.Thread(target=self.watch, args=(request.watch_s, done),
                             daemon=True).start()
        while True:
            try:
                _, status = os.waitpid(child.pid, 0)
                break
            except ChildProcessError:
                status = 255 << 8
                break
        signum: int | None = None
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            code = 128 + signum
        else:
            code = os.WEXITSTATUS(status)
        done.set()
        # What of the job is left here (tagged, or below this agent): none, and the
        # controller need not come back to sweep this host.
        reap_orphans()
        left = len(set(job_pids(self.job_id)) | set(descendants(os.getpid())))
        with suppress(OSError):
            say("exit", Exited(code=None if signum is not None else code, signal=signum,
                               left=left))
        return code


    def watch(self, every_s: float, done: threading.Event) -> None:
        """While the rank runs: other users' processes on the GPUs the job leases here, said
        whenever they change (the controller logs each, lists them for ``status`` and names
        them in the job's ending); nothing is stopped."""
        seen: dict[str, str] = {}
        while not done.wait(every_s):
            with suppress(Exception):  # a failing nvidia-smi or book: look again later
                lease = self.book().own(self.job_id)
                now = {} if lease is None else \
                    {str(pid): line for pid, line in told(usage(), lease).items()}
                if now != seen and not done.is_set():
                    say("foreign", ForeignUse(now))
                    seen = now


def checked(script: str) -> str:
    """The launch script's path, re-checked right before ``bash`` opens it by that path: every
    folder above the run directory again, the run directory and its sidecar folder the user's
    own 0700 folders, the script a file of the user's nobody else may write
    (:func:`orchestrate.hostside.safeplace.runnable`). Refused, the rank's log says why."""
    try:
        return runnable(os.path.dirname(script), os.path.basename(script), (SIDECAR_DIR,))
    except UnsafePlace as exc:
        raise RuntimeError(f"refused to run {script}: unsafe place: {exc}; fix: "
                           f"{exc.unsafe.fix}") from None


def serve() -> int:
    state = Serving()
    become_subreaper()  # what a rank starts stays below this agent, whatever it does
    signal.signal(signal.SIGHUP, state.hangup)
    if os.isatty(0):
        import termios
        import tty

        with suppress(termios.error):
            tty.setraw(0)
    say("ready", Ready(os.getpid(), socket.gethostname()))
    requests = Requests()
    while True:
        line = requests.next()
        if line is None:
            state.unclaim()
            return 0
        try:
            request = read_request(line)
        except WireError as exc:  # a request that does not fit its record: said, not obeyed
            say("error", {"detail": str(exc)})
            continue
        try:
            ended = obey(state, request)
        except Exception as exc:  # one bad request is reported, the channel stays usable
            say("error", {"detail": f"{request.OP}: {type(exc).__name__}: {exc}"})
            continue
        if ended is not None:
            return ended


def obey(state: Serving, request: Record) -> int | None:
    """Carry out one request and answer it; the agent's exit status once it is to end."""
    if isinstance(request, Abort):
        state.unclaim()
        return 0
    if isinstance(request, Preflight):
        say("preflight", preflight(request))
    elif isinstance(request, Claim):
        say("claim", state.claim(request))
    elif isinstance(request, Queue):
        say("queue", state.queue(request))
    elif isinstance(request, Files):
        say("files", state.files(request))
    elif isinstance(request, (Listen, Unlisten, Reach)):
        say(request.OP, state.master(request))
    elif isinstance(request, TrainingProgress):
        say("progress", progress_marker(request.run_dir, request.checkpoint_dir))
    elif isinstance(request, Start):
        # The rank ended; the job may not have. Stay, holding the lease and whatever the rank
        # left below, until the controller says the job is over ("end") or goes away (SIGHUP).
        state.code = state.start(request)
    elif isinstance(request, End):
        if request.grace_s is not None:
            state.grace_s = float(request.grace_s)
        say("ended", Ended(state.finish()))
        return state.code
    return None


def main(argv: list[str], out: IO[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve()
    if argv[:1] == ["reap"] and len(argv) in (3, 4):
        result: dict[str, Any] = stop_job(argv[1], float(argv[2]),
                                          argv[3] if len(argv) == 4 and argv[3] else None)
        out.write(MARK + "reap " + json.dumps(result) + "\n")
        return 0
    if argv[:1] == ["gpus"] and len(argv) in (1, 2):
        answer = machine_gpus(argv[1] if len(argv) == 2 else None)
        if answer["gpus"]:
            answer["gpu_health"] = gather_health()
        out.write(MARK + "gpus " + json.dumps(answer) + "\n")
        return 0
    if argv[:1] == ["queue"] and len(argv) in (1, 2):
        try:
            answer = machine_queue(argv[1] if len(argv) == 2 and argv[1] else None)
        except BookError as exc:
            answer = {"no_answer": f"lease book: {exc}"}
        out.write(MARK + "queue " + json.dumps(answer) + "\n")
        return 0
    if argv[:1] == ["progress"] and len(argv) == 3:
        marker = progress_marker(argv[1], argv[2] or None)
        out.write(MARK + "progress " + json.dumps(marker) + "\n")
        return 0
    out.write("usage: agent serve | agent reap JOB_ID GRACE_S [LEASE_DIR] | agent gpus "
              "[LEASE_DIR] | agent queue [LEASE_DIR] | agent progress RUN_DIR CKPT\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdout))
