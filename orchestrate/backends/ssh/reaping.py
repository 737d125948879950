"""Stopping a job on every host: the agent's kill-by-tag, run on all hosts in parallel.

Every process a launch script starts carries ``ORCHESTRATE_JOB_ID`` in its environment, so the
agent finds them by scanning ``/proc/*/environ`` even when they left the session (torchrun's
workers, daemonised helpers): SIGTERM and SIGCONT, a grace period, then SIGKILL. The same run
also drops the job's lease on the host. A host that cannot be reached is reported, never waited
on beyond its connect timeout plus the grace period.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from orchestrate.backends.ssh.agent import MARK
from orchestrate.backends.ssh.channels import AgentChannel, ChannelError, agent_command
from orchestrate.backends.ssh.connections import ConnectError, Links, Target, fan_out
from orchestrate.backends.ssh.wire import TrainingProgress
from orchestrate.core.plan.plan import Plan, checkpoint_dir

#: Seconds past the grace period a kill-by-tag run may take before the host is given up on.
SLACK_S = 15.0


@dataclass(frozen=True)
class Reaped:
    """What kill-by-tag did on one host."""

    found: int
    killed: int  # needed SIGKILL
    survivors: tuple[str, ...] = ()  # processes still alive after SIGKILL, named


def reap_host(links: Links, target: Target, job_id: str, grace_s: float) -> Reaped:
    """Kill-by-tag on one host; raises (ConnectError, TimeoutError, ...) when it cannot."""
    link = links.get(target)
    result = link.run(agent_command(target.python, "reap", job_id, f"{grace_s:g}",
                                    target.lease_dir or ""),
                      timeout=target.connect_timeout_s + 2 * grace_s + SLACK_S)
    for line in result.output.split("\n"):  # not splitlines(): it splits at MARK's \x1e
        if line.startswith(MARK + "reap "):
            data = json.loads(line[len(MARK) + 5:])
            return Reaped(found=int(data["found"]), killed=int(data["killed"]),
                          survivors=tuple(str(s) for s in data.get("survivors") or ()))
    tail = " | ".join(result.output.strip().split("\n")[-3:])
    raise RuntimeError(f"kill-by-tag failed (exit {result.code}): {tail}")


def progress_on(plan: Plan, targets: Mapping[str, Target], kept: Links | None = None,
                idle: AgentChannel | None = None) -> dict[str, int | None]:
    """How far training got, read on the host of rank 0 (whose run directory has the
    checkpoints and metrics; no shared file system is assumed). Nothing known on a failure.
    ``kept``: the job's open connections (no login of its own; they stay open). ``idle``:
    rank 0's agent channel before its rank starts, asked there (a request on a running agent,
    where the ``progress`` mode starts a shell and an interpreter on the host first)."""
    target = targets[plan.nodes[0].name]
    if idle is not None:
        found = ask_progress(idle, plan, target.connect_timeout_s + SLACK_S)
        if found is not None:
            return found
    links = kept if kept is not None else Links()
    try:
        result = links.get(target).run(
            agent_command(target.python, "progress", plan.run_dir, checkpoint_dir(plan) or ""),
            timeout=target.connect_timeout_s + SLACK_S)
    except Exception:  # an unreachable host: progress unknown, the budget still bounds restarts
        return {"checkpoint_step": None, "step": None}
    finally:
        if kept is None:
            links.close()
    for line in result.output.split("\n"):
        if line.startswith(MARK + "progress "):
            data: dict[str, int | None] = json.loads(line[len(MARK) + 9:])
            return data
    return {"checkpoint_step": None, "step": None}


def ask_progress(channel: AgentChannel, plan: Plan, timeout: float
                 ) -> dict[str, int | None] | None:
    """How far training got, asked of a serving agent on rank 0's host; None when it cannot
    answer within ``timeout`` (then :func:`progress_on` asks the host the way that needs none)."""
    try:
        answer = channel.request(TrainingProgress(plan.run_dir, checkpoint_dir(plan)),
                                 "progress", timeout)
    except (ChannelError, OSError, EOFError):
        return None
    return {"checkpoint_step": answer.get("checkpoint_step"), "step": answer.get("step")}


def describe_failure(exc: Exception) -> str:
    """A one-line reason a host could not be stopped."""
    if isinstance(exc, ConnectError):
        return exc.detail
    if isinstance(exc, TimeoutError):
        return f"no answer: {exc}"
    return str(exc) or type(exc).__name__


def sweep(
    links: Links, targets: Iterable[Target], job_id: str, grace_s: float, fanout: int,
    survivors: dict[str, list[str]] | None = None,
) -> dict[str, str]:
    """Kill-by-tag on every host at once; returns a failure reason per host that failed (and
    adds to ``survivors`` what outlived SIGKILL, by host)."""
    results = fan_out(list(targets), lambda t: reap_host(links, t, job_id, grace_s), fanout)
    if survivors is not None:
        for name, r in results.items():
            if r.value is not None and r.value.survivors:
                survivors.setdefault(name, []).extend(r.value.survivors)
    return {
        name: describe_failure(r.error) for name, r in results.items() if r.error is not None
    }


class HostStopper:
    """Stops a running job host by host, at most one kill-by-tag run per host at a time."""

    def __init__(
        self,
        links: Links,
        targets: Mapping[str, Target],
        job_id: str,
        grace_s: float,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.links = links
        self.targets = dict(targets)
        self.job_id = job_id
        self.grace_s = grace_s
        self.note = note or (lambda text: print(text, file=sys.stderr, flush=True))
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        #: What outlived SIGKILL, named, by host.
        self.survivors: dict[str, list[str]] = {}

    def stop(self, node: str, force: bool) -> None:
        """Start kill-by-tag on ``node``'s host unless one is running (it ends in SIGKILL
        anyway, so a forced stop needs no second run)."""
        with self._lock:
            running = self._threads.get(node)
            if running is not None and running.is_alive():
                return
            if running is not None and not force:
                return
            thread = threading.Thread(target=self._reap, args=(node,), daemon=True)
            self._threads[node] = thread
            thread.start()

    def _reap(self, node: str) -> None:
        target = self.targets[node]
        try:
            reaped = reap_host(self.links, target, self.job_id, self.grace_s)
            if reaped.survivors:
                with self._lock:
                    self.survivors.setdefault(node, []).extend(reaped.survivors)
        except Exception as exc:
            self.note(f"could not stop the job's processes on {target.label}: "
                      f"{describe_failure(exc)}")

    def wait(self, timeout: float) -> None:
        """Wait for the kill-by-tag runs in flight."""
        for thread in list(self._threads.values()):
            thread.join(timeout)

    def sweep(self, fanout: int, skip: Iterable[str] = ()) -> dict[str, str]:
        """Kill-by-tag on every host but ``skip`` (after the runs in flight); failure reasons
        by host."""
        self.wait(self.grace_s + SLACK_S)
        skipped = set(skip)
        todo = [t for name, t in self.targets.items() if name not in skipped]
        # A host whose connection died is not tried again: it is gone (and said so once).
        lost = {t.name: self.links.get(t).lost for t in todo if self.links.get(t).lost}
        todo = [t for t in todo if t.name not in lost]
        failed = sweep(self.links, todo, self.job_id, self.grace_s, fanout, self.survivors)
        failed.update({name: str(why) for name, why in lost.items()})
        for node, why in failed.items():
            self.note(f"could not stop the job's processes on {self.targets[node].label}: {why}")
        return failed
