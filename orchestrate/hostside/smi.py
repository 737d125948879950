"""Asking ``nvidia-smi``, one way for every question: a bounded run whose failure is data, and
its CSV read into rows by field name (by :mod:`orchestrate.hostside.smicsv`, the pure cell
reader the health verdicts share: ``rows``, ``value`` and ``number`` are its, offered here too).

Two modules ask it. :mod:`orchestrate.hostside.hostfacts` asks what the GPUs *are* (model,
memory, links: once per probe, parsed by :mod:`orchestrate.probe.facts`);
:mod:`orchestrate.hostside.gpuuse` asks what they are *doing* (memory used, compute processes:
at every submit, in the SSH agent's check and in ``orchestrate gpus``). Both run the query here
and read it here, so a missing ``nvidia-smi``, a driver that fails, one that hangs (a GPU that
fell off the bus) and a process name with a comma in it mean the same in both, and the model a
person sees in ``orchestrate gpus`` is parsed from the same cells as the one a job plans with.

The bounded runner (:func:`start`, :func:`finish`, :func:`stop`, :func:`run`) lives here because
``nvidia-smi`` is the command that hangs; the gatherer runs its other commands (``ip``,
``lspci``) through it too. Standard library only, Python 3.8+ (shipped inside the SSH agent, the
watchdog and the fact gatherer).
"""

from __future__ import annotations

import contextlib
import subprocess  # running nvidia-smi is this module's whole job

from orchestrate.hostside.smicsv import number, rows, value

TYPE_CHECKING = False  # typing costs start-up time on every host; only the checker needs it
if TYPE_CHECKING:
    from typing import Any, Sequence, Tuple, Union

    Started = Union["subprocess.Popen[bytes]", Tuple[Union[int, None], str, str]]

#: The exit status :func:`finish` reports for a command that could not start or did not end in
#: time (its message then says which).
NO_STATUS = -1


def start(argv: list[str]) -> Started:
    """A command started in the background, or (when it cannot start) what :func:`run` says:
    ``(None, "", "")`` for a program not found, ``(NO_STATUS, "", why)`` otherwise."""
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    except FileNotFoundError:
        return None, "", ""
    except OSError as exc:
        return NO_STATUS, "", f"{argv[0]}: {exc}"


def finish(started: Started, timeout: float, program: str) -> tuple[int | None, str, str]:
    """Exit status, stdout and stderr of ``program``, which :func:`start` started, waiting at
    most ``timeout`` seconds (then it is killed: a timeout is an answer, never a hang)."""
    if isinstance(started, tuple):
        return started
    try:
        out, err = started.communicate(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        stop(started)
        return NO_STATUS, "", f"{program} did not answer within {timeout:.3g}s"
    return (started.returncode, out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"))


def stop(started: Started) -> None:
    """Kill a command :func:`start` started that is no longer wanted (and reap it, unless even
    SIGKILL does not end it soon: a process stuck in the driver)."""
    if isinstance(started, tuple) or started.poll() is not None:
        return
    started.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        started.communicate(timeout=1.0)


def run(argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Exit status (None: not found), stdout and stderr of a bounded command."""
    return finish(start(argv), timeout, argv[0])


def message(code: int | None, out: str, err: str) -> str:
    """What a failed command said, in one string, with its exit status."""
    text = "\n".join(x.strip() for x in (out, err) if x.strip())
    if code == NO_STATUS and text and not out.strip():
        return text  # did not start, or did not answer: the runner's own sentence
    return f"{text} (exit status {code})" if text else f"exit status {code}"


def query(what: str, fields: Sequence[str], timeout: float) -> dict[str, Any]:
    """``nvidia-smi --query-WHAT=FIELDS --format=csv,nounits`` (``what``: ``gpu`` or
    ``compute-apps``), bounded: ``{"status": "ok" | "missing" | "failed", "text": the CSV with
    its header or None, "error": why not or None}``. Missing means no ``nvidia-smi``: no GPUs."""
    code, out, err = run(["nvidia-smi", f"--query-{what}=" + ",".join(fields),
                          "--format=csv,nounits"], timeout)
    if code == 0:
        return {"status": "ok", "text": out, "error": None}
    if code is None:
        return {"status": "missing", "text": None, "error": "nvidia-smi not found on PATH"}
    return {"status": "failed", "text": None, "error": message(code, out, err)}


def said(answer: dict[str, Any]) -> str:
    """A failed :func:`query` as one sentence for a person."""
    error = str(answer.get("error") or "")[-300:]
    return error if error.startswith("nvidia-smi") else f"nvidia-smi failed: {error}"


__all__ = ["NO_STATUS", "finish", "message", "number", "query", "rows", "run", "said", "start",
           "stop", "value"]
