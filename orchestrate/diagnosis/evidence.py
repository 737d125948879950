"""The evidence ranks leave in a run dir, read from the launcher's side: heartbeats, dumps on
request, and the diagnosis made of them.

The ranks' sidecars (``orchestrate.diagnosis.sidecar``) write the files; the launcher never talks to
a rank, so a frozen rank costs it nothing but a deadline. Standard library only and Python 3.8+
(with ``orchestrate.core.layout`` and ``orchestrate.diagnosis.stall``): a launcher inside a Slurm
batch script runs it with the node's python.

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
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from orchestrate.core.layout import (
    DIAG_DIAGNOSIS,
    DIAG_DIR,
    DIAG_REQUEST,
    heartbeat_file,
)
from orchestrate.diagnosis.stall import Diagnosis, Stall, classify

DEFAULT_COLLECT_S = 4.0
_sequence = itertools.count(1)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def read_heartbeats(run_dir: Path, ranks: Iterable[int]) -> dict[int, dict[str, Any] | None]:
    """Each rank's last heartbeat, or None where there is none (yet) or it is unreadable."""
    out: dict[int, dict[str, Any] | None] = {}
    for rank in ranks:
        beat = _read_json(heartbeat_file(run_dir, rank))
        out[rank] = beat if isinstance(beat, dict) else None
    return out


def new_request_id(at: float | None = None) -> str:
    """A fresh dump request id (also a folder name in ``diag/``)."""
    at = time.time() if at is None else at
    return f"{int(at * 1000)}-{os.getpid()}-{next(_sequence)}"


def request_dump(run_dir: Path, *, at: float | None = None, request_id: str | None = None
                 ) -> str:
    """Ask every rank's sidecar for its stacks and flight recorder; returns the request id
    (``request_id``: one the caller chose, the same on every host of an SSH job)."""
    at = time.time() if at is None else at
    request_id = request_id or new_request_id(at)
    _write_atomic(
        run_dir / DIAG_DIR / DIAG_REQUEST, json.dumps({"id": request_id, "t": at})
    )
    return request_id


def _answer(folder: Path, rank: int) -> dict[str, Any]:
    prefix = folder / f"rank-{rank}"
    done = _read_json(prefix.with_name(prefix.name + ".done"))
    files = [str(f) for f in (done or {}).get("files") or []]
    try:
        stacks: str | None = prefix.with_name(prefix.name + ".stacks.txt").read_text(
            encoding="utf-8", errors="replace"
        )
    except OSError:
        stacks = None
    state = _read_json(prefix.with_name(prefix.name + ".state.json"))
    return {
        "state": state if isinstance(state, dict) else None,
        "stacks": stacks,
        "files": files,
        "done": done,
    }


def collect(
    run_dir: Path, ranks: Iterable[int], timeout_s: float = DEFAULT_COLLECT_S,
    *, poll_s: float = 0.05, request_id: str | None = None,
) -> dict[str, Any]:
    """Request dumps and wait up to ``timeout_s`` for each rank's answer.

    Returns ``{"id", "dir", "waited_s", "ranks": {rank: answer | None}, "silent": [...]}``; an
    answer is ``{"state": fresh heartbeat with "proc", "stacks": text, "files": [...],
    "done": {...}}``; None marks a rank that did not answer in time (the frozen signal).
    """
    wanted = sorted(set(ranks))
    request_id = request_dump(run_dir, request_id=request_id)
    folder = run_dir / DIAG_DIR / request_id
    started = time.monotonic()
    deadline = started + max(0.0, timeout_s)
    pending = set(wanted)
    while pending:
        for rank in sorted(pending):
            if (folder / f"rank-{rank}.done").exists():
                pending.discard(rank)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    answers: dict[int, dict[str, Any] | None] = {
        rank: None if rank in pending else _answer(folder, rank) for rank in wanted
    }
    return {
        "id": request_id,
        "dir": str(folder),
        "waited_s": time.monotonic() - started,
        "ranks": answers,
        "silent": sorted(pending),
    }


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
    collected: Mapping[str, Any] | None = None,
) -> Diagnosis:
    """Collect every rank's dump (unless ``collected`` is given), classify, and keep the
    result in ``diag/diagnosis.json``."""
    wanted = sorted(set(ranks))
    if collected is None:
        collected = collect(run_dir, wanted, timeout_s)
    heartbeats = read_heartbeats(run_dir, wanted)
    diagnosis = classify(
        heartbeats, collected["ranks"], time.time(), nodes, master, interface,
        stall=stall, alive=alive,
    )
    write_diagnosis(run_dir, diagnosis, collected["id"])
    return diagnosis


def write_diagnosis(run_dir: Path, diagnosis: Diagnosis, request_id: str | None = None) -> Path:
    """Keep a diagnosis as ``diag/diagnosis.json`` (the latest; ``status --json`` shows it)
    and beside its dumps."""
    text = json.dumps(diagnosis.as_dict(), indent=2)
    latest = run_dir / DIAG_DIR / DIAG_DIAGNOSIS
    if request_id is not None:
        _write_atomic(run_dir / DIAG_DIR / request_id / DIAG_DIAGNOSIS, text)
    _write_atomic(latest, text)
    return latest


def read_diagnosis(run_dir: Path) -> dict[str, Any] | None:
    """The latest diagnosis (``{kind, ranks, nodes, summary, at, files}``), or None."""
    found = _read_json(run_dir / DIAG_DIR / DIAG_DIAGNOSIS)
    return found if isinstance(found, dict) else None


#: The most of one rank's flight-recorder dump an SSH host sends back (the rest stays there).
FR_SEND_BYTES = 1 << 20


def main(argv: list[str]) -> int:
    """The host side of an SSH job's stall watch (``evidence.py`` in the run directory, run
    with ``python -S``), one JSON object on stdout:

    - ``heartbeats RUN_DIR RANKS``: ``{"t": host time, "heartbeats": {rank: beat | null}}``;
    - ``collect RUN_DIR RANKS TIMEOUT_S REQUEST_ID``: ask this host's ranks for dumps and wait
      (:func:`collect`); ``{"t", "heartbeats", "collected": {..., "ranks": {rank: answer with
      "fr_text": the flight recorder's text, at most FR_SEND_BYTES}}}``.

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
        for answer in collected["ranks"].values():
            if answer is None:
                continue
            for name in answer.get("files") or []:
                if str(name).endswith(".fr.json"):
                    try:
                        with open(name, "rb") as f:
                            answer["fr_text"] = f.read(FR_SEND_BYTES).decode("utf-8", "replace")
                    except OSError:
                        pass
        collected["ranks"] = {str(k): v for k, v in collected["ranks"].items()}
        out["collected"] = collected
    out["heartbeats"] = {str(k): v for k, v in read_heartbeats(run_dir, ranks).items()}
    print(json.dumps(out))
    return 0
