"""An SSH job's stall evidence: the ranks' heartbeats and dumps, fetched from their hosts.

No shared file system is assumed, so each rank's sidecar writes into the run directory on its
own host. The stall watch (:mod:`orchestrate.diagnosis.hangwatch`) reads them through this class:
one short command per host (``python -S RUN_DIR/evidence.py``, the program the run directory got
with the job's files) on the connections the supervisor already holds, all hosts at once. What
comes back is mirrored into the controller's run directory (``diag/hb``, ``diag/<request>/``),
so ``orchestrate diagnose``, the report and a later look see the same files as on a local job.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrate.backends.ssh.connections import Links, Target, fan_out
from orchestrate.core.layout import DIAG_DIR, EVIDENCE_PROGRAM, heartbeat_file
from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.evidence import new_request_id

#: Seconds a host may take beyond its connect timeout to answer a heartbeat read.
READ_SLACK_S = 10.0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _answer_json(output: str) -> dict[str, Any]:
    """The JSON object a host printed (the last line that is one)."""
    for line in reversed(output.strip().split("\n")):
        line = line.strip()
        if line.startswith("{"):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    raise RuntimeError(f"no answer: {output.strip()[-300:]!r}")


class RemoteEvidence:
    """:class:`orchestrate.diagnosis.hangwatch.Evidence` over SSH, for one attempt's plan."""

    def __init__(self, plan: Plan, targets: Mapping[str, Target], links: Links, fanout: int,
                 local_run_dir: Path) -> None:
        self.plan = plan
        self.targets = dict(targets)
        self.links = links
        self.fanout = fanout
        self.local = local_run_dir
        self.ranks_on = {n.name: [r.rank for r in n.ranks] for n in plan.nodes}

    def _command(self, target: Target, *args: str) -> str:
        program = f"{self.plan.run_dir}/{EVIDENCE_PROGRAM}"
        return " ".join(shlex.quote(a) for a in (target.python, "-S", program, *args))

    def _hosts(self) -> list[Target]:
        return [self.targets[name] for name in self.ranks_on if name in self.targets
                and not self.links.get(self.targets[name]).lost]

    def heartbeats(self) -> dict[int, dict[str, Any] | None]:
        def read(target: Target) -> dict[str, Any]:
            ranks = ",".join(map(str, self.ranks_on[target.name]))
            result = self.links.get(target).run(
                self._command(target, "heartbeats", self.plan.run_dir, ranks),
                timeout=target.connect_timeout_s + READ_SLACK_S)
            return _answer_json(result.output)

        beats: dict[int, dict[str, Any] | None] = {
            r.rank: None for r in self.plan.ranks}
        for got in fan_out(self._hosts(), read, self.fanout).values():
            if got.value is None:
                continue  # unreachable now: its ranks keep their last beats' ages in the watch
            for rank, beat in (got.value.get("heartbeats") or {}).items():
                if isinstance(beat, dict):
                    beats[int(rank)] = beat
                    _write(heartbeat_file(self.local, int(rank)), json.dumps(beat))
        return beats

    def collect(self, timeout_s: float) -> dict[str, Any]:
        request_id = new_request_id()
        folder = self.local / DIAG_DIR / request_id

        def ask(target: Target) -> dict[str, Any]:
            ranks = ",".join(map(str, self.ranks_on[target.name]))
            result = self.links.get(target).run(
                self._command(target, "collect", self.plan.run_dir, ranks, f"{timeout_s:g}",
                              request_id),
                timeout=target.connect_timeout_s + timeout_s + READ_SLACK_S)
            return _answer_json(result.output)

        answers: dict[int, dict[str, Any] | None] = {r.rank: None for r in self.plan.ranks}
        waited = 0.0
        for got in fan_out(self._hosts(), ask, self.fanout).values():
            if got.value is None:
                continue
            collected = got.value.get("collected") or {}
            waited = max(waited, float(collected.get("waited_s") or 0.0))
            for rank_text, answer in (collected.get("ranks") or {}).items():
                if isinstance(answer, dict):
                    answers[int(rank_text)] = self._mirror(folder, int(rank_text), answer)
        return {"id": request_id, "dir": str(folder), "waited_s": waited, "ranks": answers,
                "silent": sorted(r for r, a in answers.items() if a is None)}

    def _mirror(self, folder: Path, rank: int, answer: dict[str, Any]) -> dict[str, Any]:
        """Keep one rank's answer in the controller's run directory; the answer, with the
        files named where they now are."""
        files: list[str] = []
        parts: Sequence[tuple[str, Any]] = (
            ("stacks.txt", answer.get("stacks")),
            ("state.json", None if answer.get("state") is None else json.dumps(answer["state"])),
            ("fr.json", answer.get("fr_text")),
        )
        for suffix, text in parts:
            if isinstance(text, str):
                path = folder / f"rank-{rank}.{suffix}"
                _write(path, text)
                files.append(str(path))
        _write(folder / f"rank-{rank}.done", json.dumps(answer.get("done") or {}))
        return {"state": answer.get("state"), "stacks": answer.get("stacks"), "files": files,
                "done": answer.get("done")}
