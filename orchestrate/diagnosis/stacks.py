"""Where a rank is: its main thread's frames from a dump's stacks, and which frame is the
user's own code.

A rank's stacks file (:class:`orchestrate.diagnosis.diagfiles.AnswerFiles`) is faulthandler's
dump of every thread after a header the sidecar writes (``# main thread 0x...``, ``# stdlib
...``); a heartbeat carries the main thread's innermost frames. Either way the frame worth
naming is the innermost one in the program's own code: not the standard library, an installed
package, torch, or the sidecar itself. After the rank's threads the file may hold one section
per forked child that answered (DataLoader workers, :mod:`orchestrate.diagnosis.workers`), each
from a ``# worker pid P: state S, wchan W, syscall C, target T`` line: :func:`worker_stacks`
reads them. Pure, standard library only, Python 3.8+.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrate.diagnosis.diagfiles import Frame
from orchestrate.diagnosis.kernelstate import KernelState

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_MAIN = re.compile(r"^# main thread (0x[0-9a-fA-F]+)")
_STDLIB = re.compile(r"^# stdlib (.*)$")
_STDLIB_PATH = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\]")
_OURS = re.compile(r"[/\\]orchestrate[/\\](\w+[/\\])*\w+\.py$")
#: The sidecar folder's private package (orchestrate.diagnosis.rankpackage).
_SIDECAR = re.compile(r"[/\\]_orchestrate_rank[/\\]")
_WORKER = re.compile(
    r"^# worker pid (\d+): state (\S+), wchan (\S+), syscall (\S+), target (.*)$", re.M)
#: torch's DataLoader waiting for a batch from its worker processes (multi-process iterator).
_LOADER_FILE = re.compile(r"[/\\]torch[/\\]utils[/\\]data[/\\]dataloader\.py$")
_LOADER_WAITS = ("_try_get_data", "_get_data")


def frame_kind(path: str, stdlib: str | None = None) -> str:
    """``user`` (the program's code), ``ours`` (orchestrate's trainer) or ``library``."""
    if path.startswith("<") or path.endswith("sitecustomize.py") or _SIDECAR.search(path):
        return "library"
    if stdlib and path.startswith(stdlib.rstrip("/\\") + "/"):
        return "library"
    if "site-packages" in path or "dist-packages" in path or _STDLIB_PATH.search(path):
        return "library"
    if re.search(r"[/\\]torch[/\\]", path):
        return "library"
    if _OURS.search(path):
        return "ours"
    return "user"


def innermost_user_frame(frames: Sequence[Frame], stdlib: str | None = None) -> Frame | None:
    """The innermost frame of the user's code, else of orchestrate's, else the innermost."""
    for wanted in ("user", "ours"):
        for frame in frames:
            if frame_kind(frame.file, stdlib) == wanted:
                return frame
    return frames[0] if frames else None


def waits_for_loader_worker(frames: Sequence[Frame]) -> bool:
    """Whether these frames (innermost first) wait in torch's DataLoader for a batch from one
    of its worker processes."""
    return any(f.function in _LOADER_WAITS and _LOADER_FILE.search(f.file) for f in frames)


@dataclass(frozen=True)
class WorkerStack:
    """One forked child's section of a rank's stacks file."""

    pid: int
    frames: tuple[Frame, ...]  # its main thread's, innermost first (empty: no answer)
    stdlib: str | None
    kernel: KernelState


def worker_stacks(text: str) -> list[WorkerStack]:
    """The forked children's sections of a rank's stacks file, in file order."""
    found = list(_WORKER.finditer(text))
    out = []
    for index, match in enumerate(found):
        end = found[index + 1].start() if index + 1 < len(found) else len(text)
        frames, stdlib = parse_stacks(text[match.end():end])
        fields = [None if value == "-" else value for value in match.group(2, 3, 4, 5)]
        state = None if fields[0] == "?" else fields[0]
        out.append(WorkerStack(int(match.group(1)), tuple(frames), stdlib,
                               KernelState(state, fields[1], fields[2], fields[3])))
    return out


def parse_stacks(text: str) -> tuple[list[Frame], str | None]:
    """The main thread's frames (innermost first) from a sidecar's stacks file (faulthandler
    format after a ``# main thread 0x...`` header), and the rank's stdlib folder. Without the
    header the first thread that is not the dumping one is taken. The forked children's
    sections at the end (:func:`worker_stacks`) are not the rank's."""
    worker = _WORKER.search(text)
    if worker is not None:
        text = text[:worker.start()]
    main_id = None
    stdlib = None
    threads: list[tuple[str, bool, list[Frame]]] = []
    for line in text.splitlines():
        if line.startswith("#"):
            found = _MAIN.match(line)
            if found:
                main_id = found.group(1).lower()
            found = _STDLIB.match(line)
            if found:
                stdlib = found.group(1).strip()
            continue
        header = _THREAD.match(line)
        if header:
            threads.append((header.group(2).lower(), header.group(1) == "Current thread", []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][2].append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    for ident, _current, frames in threads:
        if main_id is not None and int(ident, 16) == int(main_id, 16):
            return frames, stdlib
    for _ident, current, frames in threads:
        if not current:
            return frames, stdlib
    return (threads[0][2] if threads else []), stdlib
