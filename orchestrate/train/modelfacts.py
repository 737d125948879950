"""What ``load`` learns of a job's model for the memory plan: its size, layout and traced peaks.

The job's model factory is the user's code, and a traced step imports torch and runs a few
seconds: both happen in a child process (``python -m orchestrate.train.modelprobe``, run in the
job's workdir) under one deadline, so a slow, hanging or crashing factory costs at most
``train.memory_trace_s`` seconds (60 by default; 0 builds the model on the meta device for its
size and layout, within :data:`FACTS_ONLY_S`, and traces nothing) and never the plan. The child
runs in its own session with a tag of its own (:data:`orchestrate.hostside.host.TAG`), and both
are killed when the plan has its answer: processes (and so ports) the factory started do not
outlive the plan. Whatever
was answered before the deadline is kept; every layout that was not traced is estimated by the
formula, and the plan says why (``ModelFacts.notes``).

Only jobs whose plan uses the numbers ask: a ``train:`` job without ``model_params`` that runs
on GPUs or whose strategy is not plain DDP. Others (``command:`` jobs, DDP on CPUs) are planned
exactly as before, without the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.plan.memory import ModelFacts, TracedPeak, options_for
from orchestrate.core.spec.inventory import Inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.hostside import host
from orchestrate.train import tracecache

#: The deadline of a probe that traces nothing (``memory_trace_s: 0``).
FACTS_ONLY_S = 30.0
_FIELD = "train.memory_trace_s"
#: The note of a plan whose traces came from the cache (orchestrate/train/tracecache.py).
REUSED = ("memory traced earlier for the same model, layouts and torch, reused (the trace "
          "cache in the state directory; ORCHESTRATE_TRACE_CACHE=0 traces again)")
#: The world size FSDP layouts are traced at; the plan scales the shards to its own.
TRACE_WORLD = 2
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def wanted(job: JobSpec, inventory: Inventory) -> bool:
    """Whether the plan of ``job`` uses a model's measured facts."""
    train = job.train
    if train is None or train.model_params is not None:
        return False
    return train.strategy != "ddp" or any(node.is_gpu for node in inventory.nodes)


def _reader(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _requests(job: JobSpec) -> list[dict[str, Any]]:
    assert job.train is not None
    if job.train.memory_trace_s == 0:
        return []
    batch = job.train.batch_size
    return [{"trace": option, "world": TRACE_WORLD if option.startswith("fsdp") else 1,
             "batch": batch} for option in options_for(job.train)]


def _facts(answer: dict[str, Any], source: str) -> ModelFacts:
    """The model's facts; a ``fsdp.wrap`` (or activation_checkpointing) naming classes the
    model does not have is the user's mistake: exit 2 naming the classes it has."""
    problem = answer.get("problem")
    if problem:
        raise UserError(Problem(problem["message"], source=source,
                                field=f"train.{problem['field']}", got=problem.get("got"),
                                hint=problem.get("hint")))
    return ModelFacts(
        params=float(answer["params"]), largest_unit=answer.get("largest_unit"),
        wrap_classes=tuple(answer.get("wrap_classes", ())),
        classes=tuple(answer.get("classes", ())), batchnorm=tuple(answer.get("batchnorm", ())))


def probe(job: JobSpec, workdir: Path, source: str, *, deadline_s: float | None = None
          ) -> tuple[ModelFacts | None, str]:
    """The model's facts and traced peaks, or None and why not (see the module docstring)."""
    assert job.train is not None
    limit = job.train.memory_trace_s or FACTS_ONLY_S
    if deadline_s is not None:
        limit = deadline_s
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, str(workdir), env.get("PYTHONPATH", "")) if p)
    requests = [{"train": job.train.model_dump(mode="json")}, *_requests(job)]
    layouts = [str(r["trace"]) for r in requests[1:]]
    name = (tracecache.key(requests[0]["train"], requests[1:], workdir)
            if tracecache.enabled() else None)
    kept = tracecache.load(name) if name else None
    if kept is not None:
        replay: queue.Queue[str | None] = queue.Queue()
        for line in [*kept, None]:
            replay.put(line)
        facts, why = _collect(replay, time.monotonic() + limit, limit, layouts, source, [])
        if facts is not None and layouts:
            facts = replace(facts, notes=(*facts.notes, REUSED))
        return facts, why
    env[host.TAG] = tag = f"modelprobe-{os.getpid()}-{time.monotonic_ns()}"
    try:  # its own session, tagged: whatever the factory starts goes when the probe does
        child = subprocess.Popen(
            [sys.executable, "-m", "orchestrate.train.modelprobe"], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            stderr=None if os.environ.get("ORCHESTRATE_PROBE_DEBUG") else subprocess.DEVNULL)
    except OSError as exc:
        return None, f"memory check skipped: cannot start the model probe ({exc})"
    assert child.stdin is not None and child.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        child.stdin.write("".join(json.dumps(r) + "\n" for r in requests))
        child.stdin.close()
        facts, why = _collect(lines, time.monotonic() + limit, limit, layouts, source, seen)
        if facts is None and why == NO_ANSWER:
            why = _exited(child)
    except BrokenPipeError:
        return None, "memory check skipped: the model probe exited before it was asked"
    finally:
        _end(child, tag)
    if name and facts is not None and not facts.notes:  # complete: kept for the next plan
        tracecache.save(name, seen)
    return facts, why


def _exited(child: subprocess.Popen[str]) -> str:
    """Why there was no answer, with the probe's exit status when it has one."""
    try:
        code = child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return NO_ANSWER
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return f"memory check skipped: the model probe ended with {how} without an answer" + (
        " (out of memory?)" if code < 0 else "")


def _end(child: subprocess.Popen[str], tag: str) -> None:
    """Kill the probe's session, then whatever left it carrying the tag, and reap the probe."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.kill()
    child.wait()
    host.signal_all(host.job_pids(tag), signal.SIGKILL)


#: Why there is no model facts when the probe ended without an answer.
NO_ANSWER = ("memory check skipped: the model probe exited without an answer (out of memory? "
             "ORCHESTRATE_PROBE_DEBUG=1 shows its traceback)")
#: What :func:`_next` answers at the end of the child's output.
_ENDED = {"ended": True}


def _next(lines: queue.Queue[str | None], deadline: float, seen: list[str]
          ) -> dict[str, Any] | None:
    """The next answer (its line added to ``seen``), None at the deadline, :data:`_ENDED` at
    the end of the child's output."""
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return None
    if line is None:
        return dict(_ENDED)
    try:
        answer: dict[str, Any] = json.loads(line)
    except ValueError:  # not ours (the probe answers on its own pipe): read on
        return _next(lines, deadline, seen)
    seen.append(line)
    return answer


def _collect(lines: queue.Queue[str | None], deadline: float, limit: float,
             layouts: list[str], source: str, seen: list[str]
             ) -> tuple[ModelFacts | None, str]:
    first = _next(lines, deadline, seen)
    if first == _ENDED:
        return None, NO_ANSWER
    if first is None:
        return None, (f"memory check skipped: building the model on the meta device took over "
                      f"{limit:g} s ({_FIELD})")
    if first.get("kind") == "import":
        return None, "memory check skipped: torch is not installed here (set train.model_params)"
    if "error" in first:
        return None, f"memory check skipped: counting the model failed ({first['error']})"
    facts = _facts(first["facts"], source)
    failed: dict[str, list[str]] = {}  # the reason -> the layouts it stopped
    for index, layout in enumerate(layouts):
        answer = _next(lines, deadline, seen)
        if answer is None or answer == _ENDED:
            why = (f"at the {limit:g} s limit ({_FIELD})" if answer is None else
                   "when the model probe exited (out of memory?)")
            notes = [f"tracing stopped {why} before {', '.join(layouts[index:])}: estimated "
                     "by the formula"]
            break
        if "error" in answer:
            failed.setdefault(str(answer["error"]), []).append(layout)
            continue
        facts = facts.with_trace(TracedPeak.from_json(answer["traced"]))
    else:
        notes = []
    notes[:0] = [f"tracing {', '.join(which)} failed ({why}): estimated by the formula"
                 for why, which in failed.items()]
    if notes:
        facts = ModelFacts(**{**facts.__dict__, "notes": (*facts.notes, *notes)})
    return facts, ""
