"""Where a rank is: its main thread's frames from a dump's stacks, and which frame is the
user's own code.

A rank's stacks file (:class:`orchestrate.diagnosis.diagfiles.AnswerFiles`) is faulthandler's
dump of every thread after a header the sidecar writes (``# main thread 0x...``, ``# stdlib
...``); a heartbeat carries the main thread's innermost frames. Either way the frame worth
naming is the innermost one in the program's own code: not the standard library, an installed
package, torch, or the sidecar itself. Pure, standard library only, Python 3.8+.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from orchestrate.diagnosis.diagfiles import Frame

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_MAIN = re.compile(r"^# main thread (0x[0-9a-fA-F]+)")
_STDLIB = re.compile(r"^# stdlib (.*)$")
_STDLIB_PATH = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\]")
_OURS = re.compile(r"[/\\]orchestrate[/\\](\w+[/\\])*\w+\.py$")
#: The sidecar folder's private package (orchestrate.diagnosis.rankpackage).
_SIDECAR = re.compile(r"[/\\]_orchestrate_rank[/\\]")


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


def parse_stacks(text: str) -> tuple[list[Frame], str | None]:
    """The main thread's frames (innermost first) from a sidecar's stacks file (faulthandler
    format after a ``# main thread 0x...`` header), and the rank's stdlib folder. Without the
    header the first thread that is not the dumping one is taken."""
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
