"""An SSH job's stall evidence: the ranks' heartbeats and dumps, fetched from their hosts.

No shared file system is assumed, so each rank's sidecar writes into the run directory on its
own host. The stall watch (:mod:`orchestrate.diagnosis.hangwatch`) reads them through this class:
one short command per host (``python -S RUN_DIR/evidence.py``, the program the run directory got
with the job's files) on the connections the supervisor already holds, all hosts at once. Right
before it runs, the host checks its whole path again (:func:`orchestrate.backends.base.
place_check`): a labmate's ``evidence.py``, or a folder of his swapped in on the way, is refused
there, named once in the job's log, and not run. What
comes back is mirrored into the controller's run directory (``diag/hb``, ``diag/<request>/``),
so ``orchestrate diagnose``, the report and a later look see the same files as on a local job.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrate.backends.base import place_check
from orchestrate.backends.ssh.connections import Links, Target, fan_out
from orchestrate.core.layout import EVIDENCE_PROGRAM, SIDECAR_DIR
from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.diagfiles import Answer, DiagFiles, Heartbeat, Joined
from orchestrate.diagnosis.evidence import Collection, new_request_id, write_atomic

#: Seconds a host may take beyond its connect timeout to answer a heartbeat read.
READ_SLACK_S = 10.0


def _answer_json(output: str) -> dict[str, Any]:
    """The JSON object a host printed (the last line that is one)."""
    for line in reversed(output.strip().split("\n")):
        line = line.strip()
        if line.startswith("{"):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    raise RuntimeError(f"no answer: {output.strip()[-600:]}")


def evidence_command(python: str, run_dir: str, *args: str) -> str:
    """The remote command: the run directory's ``evidence.py`` run with ``args`` by the node's
    python, right after that python checked its whole path again (refused: exit 2, named)."""
    program = f"{run_dir}/{EVIDENCE_PROGRAM}"
    check = place_check(python, run_dir, EVIDENCE_PROGRAM, SIDECAR_DIR + "/")
    return check + " && " + " ".join(shlex.quote(a) for a in (python, "-S", program, *args))


class RemoteEvidence:
    """:class:`orchestrate.diagnosis.hangwatch.Evidence` over SSH, for one attempt's plan."""

    def __init__(self, plan: Plan, targets: Mapping[str, Target], links: Links, fanout: int,
                 local_run_dir: Path, attempt: int = 1,
                 note: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.note = note  # where a host's refusal to run evidence.py is said (once per host)
        self.refused: set[str] = set()
        self.attempt = attempt
        #: The processes that formed a process group, from every host's last answer.
        self._joined: dict[str, list[Joined]] = {}
        self.targets = dict(targets)
        self.links = links
        self.fanout = fanout
        self.local = local_run_dir
        self.files = DiagFiles(local_run_dir)
        self.ranks_on = {n.name: [r.rank for r in n.ranks] for n in plan.nodes}

    def _command(self, target: Target, *args: str) -> str:
        return evidence_command(target.python, self.plan.run_dir, *args)

    def _failed(self, name: str, error: BaseException | None) -> None:
        """A host that refused to run ``evidence.py`` (an unsafe place) is named once."""
        if error is not None and "refused to run" in str(error) and name not in self.refused:
            self.refused.add(name)
            if self.note is not None:
                self.note(f"{name}: stall evidence not read: {error}")

    def _hosts(self) -> list[Target]:
        return [self.targets[name] for name in self.ranks_on if name in self.targets
                and not self.links.get(self.targets[name]).lost]

    def heartbeats(self) -> dict[int, Heartbeat | None]:
        """Every host's ranks' heartbeats (mirrored here), and the processes there that joined
        a process group (:meth:`joined`)."""
        def read(target: Target) -> dict[str, Any]:
            ranks = ",".join(map(str, self.ranks_on[target.name]))
            result = self.links.get(target).run(
                self._command(target, "heartbeats", self.plan.run_dir, ranks, str(self.attempt)),
                timeout=target.connect_timeout_s + READ_SLACK_S)
            return _answer_json(result.output)

        beats: dict[int, Heartbeat | None] = {r.rank: None for r in self.plan.ranks}
        for name, got in fan_out(self._hosts(), read, self.fanout).items():
            if got.value is None:
                self._failed(name, got.error)
                continue  # unreachable now: its ranks keep their last beats' ages in the watch
            found = (Joined.from_json(j) for j in got.value.get("joined") or ())
            self._joined[name] = [j for j in found if j is not None]
            for rank, data in (got.value.get("heartbeats") or {}).items():
                beat = Heartbeat.from_json(data)
                if beat is not None:
                    beats[int(rank)] = beat
                    write_atomic(self.files.heartbeat(int(rank)), json.dumps(beat.to_json()))
        return beats

    def joined(self) -> list[Joined]:
        return [j for found in self._joined.values() for j in found]

    def collect(self, timeout_s: float) -> Collection:
        request_id = new_request_id()

        def ask(target: Target) -> dict[str, Any]:
            ranks = ",".join(map(str, self.ranks_on[target.name]))
            result = self.links.get(target).run(
                self._command(target, "collect", self.plan.run_dir, ranks, f"{timeout_s:g}",
                              request_id),
                timeout=target.connect_timeout_s + timeout_s + READ_SLACK_S)
            return _answer_json(result.output)

        answers: dict[int, Answer | None] = {r.rank: None for r in self.plan.ranks}
        waited = 0.0
        for name, got in fan_out(self._hosts(), ask, self.fanout).items():
            if got.value is None:
                self._failed(name, got.error)
                continue
            collected = Collection.from_json(got.value.get("collected") or {})
            waited = max(waited, collected.waited_s)
            for rank, answer in collected.answers.items():
                if answer is not None:
                    answers[rank] = self._mirror(request_id, rank, answer)
        return Collection(request_id, str(self.files.answers(request_id)), waited, answers)

    def _mirror(self, request_id: str, rank: int, answer: Answer) -> Answer:
        """Keep one rank's answer in the controller's run directory; the answer, with the
        files named where they now are."""
        paths = self.files.answer(request_id, rank)
        files: list[str] = []
        parts = (
            (paths.stacks, answer.stacks),
            (paths.state, None if answer.state is None else json.dumps(answer.state.to_json())),
            (paths.flight_recorder, answer.fr_text),
        )
        for path, text in parts:
            if text is not None:
                write_atomic(path, text)
                files.append(str(path))
        done = {} if answer.done is None else answer.done.to_json()
        write_atomic(paths.done, json.dumps(done))
        return replace(answer, files=tuple(files), fr_text=None)
