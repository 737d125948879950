"""The evidence ranks leave in a run dir, read from the launcher's side: heartbeats, dumps on
request, and the diagnosis made of them.

The ranks' sidecars (:mod:`orchestrate.diagnosis.sidecar`) write the files
(:mod:`orchestrate.diagnosis.diagfiles` names them and holds their records); the launcher never
talks to a rank, so a frozen rank costs it nothing but a deadline. Standard library only and
Python 3.8+ (with the modules it imports): a launcher inside a Slurm batch script runs it with
the node's python, and each SSH host runs it as ``evidence.py`` (:func:`main`).

A launcher's loop, in short::

    watch = StallWatch(stall_s, heartbeat_s)
    every second:
        stall = watch.observe(time.time(), read_heartbeats(run_dir, ranks), alive)
        if stall:
            diagnosis = diagnose(run_dir, ranks, nodes=..., master="addr:port", stall=stall)
            print(diagnosis.summary)      # then on_stall: report | kill

``diagnose`` takes about a second when every rank answers (the sidecars read the request once a
second) and ``timeout_s`` (default 4 s) when one is frozen.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrate.diagnosis.diagfiles import Answer, DiagFiles, Done, Heartbeat, Joined, Request
from orchestrate.diagnosis.stall import Diagnosis, classify
from orchestrate.diagnosis.stallrule import Stall

DEFAULT_COLLECT_S = 4.0
_sequence = itertools.count(1)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` at once (a reader sees the old file or the new one), creating its
    folder. The temporary file is this thread's own: two writers of one would interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def read_heartbeat(path: Path) -> Heartbeat | None:
    """The heartbeat in ``path``, or None where there is none (yet) or it is unreadable."""
    return Heartbeat.from_json(_read_json(path))


def read_heartbeats(run_dir: Path, ranks: Iterable[int]) -> dict[int, Heartbeat | None]:
    """Each rank's last heartbeat, or None where there is none (yet) or it is unreadable."""
    files = DiagFiles(run_dir)
    return {rank: read_heartbeat(files.heartbeat(rank)) for rank in ranks}


def read_joined(run_dir: Path, attempt: int) -> list[Joined]:
    """The processes of one attempt that formed a process group, as each recorded it."""
    folder = DiagFiles(run_dir).joined(attempt)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = (Joined.from_json(_read_json(folder / name)) for name in names
             if name.endswith(".json"))
    return [joined for joined in found if joined is not None]


@dataclass(frozen=True)
class Collection:
    """Every rank's answer to one dump request (None: no answer in time, the frozen signal)."""

    id: str
    dir: str  # the answers' folder, diag/<id>
    waited_s: float
    answers: Mapping[int, Answer | None]

    @property
    def silent(self) -> list[int]:
        """The ranks that did not answer."""
        return sorted(rank for rank, answer in self.answers.items() if answer is None)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "dir": self.dir, "waited_s": self.waited_s,
                "ranks": {str(rank): None if answer is None else answer.to_json()
                          for rank, answer in self.answers.items()},
                "silent": self.silent}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Collection:
        """The inverse of :meth:`to_json` (an SSH host's answer)."""
        return cls(str(data.get("id") or ""), str(data.get("dir") or ""),
                   float(data.get("waited_s") or 0.0),
                   {int(rank): Answer.from_json(answer)
                    for rank, answer in (data.get("ranks") or {}).items()})


def new_request_id(at: float | None = None) -> str:
    """A fresh dump request id (also a folder name in ``diag/``)."""
    at = time.time() if at is None else at
    return f"{int(at * 1000)}-{os.getpid()}-{next(_sequence)}"


def request_dump(run_dir: Path, *, at: float | None = None, request_id: str | None = None
                 ) -> str:
    """Ask every rank's sidecar for its stacks and flight recorder; returns the request id
    (``request_id``: one the caller chose, the same on every host of an SSH job)."""
    at = time.time() if at is None else at
    request = Request(request_id or new_request_id(at), at)
    write_atomic(DiagFiles(run_dir).request, json.dumps(request.to_json()))
    return request.id


def read_answer(files: DiagFiles, request_id: str, rank: int) -> Answer:
    """One rank's answer to ``request_id`` as its files hold it (parts may be missing)."""
    paths = files.answer(request_id, rank)
    done = Done.from_json(_read_json(paths.done))
    try:
        stacks: str | None = paths.stacks.read_text(encoding="utf-8", errors="replace")
    except OSError:
        stacks = None
    return Answer(read_heartbeat(paths.state), stacks, () if done is None else done.files, done)


def collect(
    run_dir: Path, ranks: Iterable[int], timeout_s: float = DEFAULT_COLLECT_S,
    *, poll_s: float = 0.05, request_id: str | None = None,
) -> Collection:
    """Request dumps and wait up to ``timeout_s`` for each rank's answer (its ``done`` file)."""
    wanted = sorted(set(ranks))
    files = DiagFiles(run_dir)
    request_id = request_dump(run_dir, request_id=request_id)
    started = time.monotonic()
    deadline = started + max(0.0, timeout_s)
    pending = set(wanted)
    while pending:
        for rank in sorted(pending):
            if files.answer(request_id, rank).done.exists():
                pending.discard(rank)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    answers = {rank: None if rank in pending else read_answer(files, request_id, rank)
               for rank in wanted}
    return Collection(request_id, str(files.answers(request_id)),
                      time.monotonic() - started, answers)


def diagnose(
    run_dir: Path,
    ranks: Iterable[int],
    *,
    nodes: Mapping[int, str],
    master: str,
    interface: str | None = None,
    stall: Stall | None = None,
    alive: Mapping[int, bool] | None = None,
    timeout_s: float = DEFAULT_COLLECT_S,
    collected: Collection | None = None,
) -> Diagnosis:
    """Collect every rank's dump (unless ``collected`` is given), classify, and keep the
    result in ``diag/diagnosis.json``."""
    wanted = sorted(set(ranks))
    if collected is None:
        collected = collect(run_dir, wanted, timeout_s)
    diagnosis = classify(
        read_heartbeats(run_dir, wanted), collected.answers, time.time(), nodes, master,
        interface, stall=stall, alive=alive,
    )
    write_diagnosis(run_dir, diagnosis, collected.id)
    return diagnosis


def write_diagnosis(run_dir: Path, diagnosis: Diagnosis, request_id: str | None = None) -> Path:
    """Keep a diagnosis as ``diag/diagnosis.json`` (the latest; ``status --json`` shows it)
    and beside its dumps."""
    files = DiagFiles(run_dir)
    text = json.dumps(diagnosis.to_json(), indent=2)
    if request_id is not None:
        write_atomic(files.diagnosis_of(request_id), text)
    write_atomic(files.diagnosis, text)
    return files.diagnosis


def read_diagnosis(run_dir: Path) -> Diagnosis | None:
    """The latest diagnosis, or None (none, or unreadable)."""
    found = _read_json(DiagFiles(run_dir).diagnosis)
    try:
        return Diagnosis.from_json(found) if isinstance(found, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


#: The most of one rank's flight-recorder dump an SSH host sends back (the rest stays there).
FR_SEND_BYTES = 1 << 20


def _with_flight_recorder(answer: Answer | None) -> Answer | None:
    """An answer with the start of its flight-recorder dump, to send over SSH."""
    if answer is None:
        return None
    for name in answer.files:
        if name.endswith(".fr.json"):
            try:
                with open(name, "rb") as f:
                    return replace(answer, fr_text=f.read(FR_SEND_BYTES).decode("utf-8", "replace"))
            except OSError:
                pass
    return answer


def main(argv: list[str]) -> int:
    """The host side of an SSH job's stall watch (``evidence.py`` in the run directory, run
    with ``python -S``), one JSON object on stdout:

    - ``heartbeats RUN_DIR RANKS [ATTEMPT]``: ``{"t": host time, "heartbeats": {rank: beat |
      null}, "joined": [the attempt's Joined records on this host]}``;
    - ``collect RUN_DIR RANKS TIMEOUT_S REQUEST_ID``: ask this host's ranks for dumps and wait
      (:func:`collect`); ``{"t", "heartbeats", "collected": Collection.to_json() with each
      answer's "fr_text": the flight recorder's text, at most FR_SEND_BYTES}``.

    RANKS is comma-separated.
    """
    if len(argv) < 3 or argv[0] not in ("heartbeats", "collect"):
        print("usage: evidence.py heartbeats RUN_DIR RANKS | "
              "collect RUN_DIR RANKS TIMEOUT_S REQUEST_ID")
        return 2
    run_dir = Path(argv[1])
    ranks = [int(r) for r in argv[2].split(",") if r]
    out: dict[str, Any] = {"t": time.time()}
    if argv[0] == "collect" and len(argv) == 5:
        collected = collect(run_dir, ranks, float(argv[3]), request_id=argv[4])
        answers = {rank: _with_flight_recorder(a) for rank, a in collected.answers.items()}
        out["collected"] = replace(collected, answers=answers).to_json()
    out["heartbeats"] = {str(rank): None if beat is None else beat.to_json()
                         for rank, beat in read_heartbeats(run_dir, ranks).items()}
    if argv[0] == "heartbeats" and len(argv) == 4:
        out["joined"] = [j.to_json() for j in read_joined(run_dir, int(argv[3]))]
    print(json.dumps(out))
    return 0
