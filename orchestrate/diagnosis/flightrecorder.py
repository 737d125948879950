"""torch's flight recorder, read from inside a rank without importing torch: each process
group's collective counters, and the op of a collective that looks stuck.

As measured on torch 2.13.0+cpu, gloo (``_dump_fr_trace_json(False, None)`` for the counters
only, ``(True, True)`` for entries): ``pg_status`` maps the group name (``"0"`` for the default
group, ``"1"``, ... for ``new_group`` in creation order, the same on every rank) to
``last_enqueued_collective``, ``last_started_collective`` and ``last_completed_collective`` as
*strings*; gloo never sets "started" (always ``"-1"``). Each entry has ``collective_seq_id``
(per group, counts from 1, barriers included), ``pg_id``, ``process_group`` = ``[name, desc]``
(``"default_pg"``, and ``"undefined"`` for a ``new_group`` without description),
``profiling_name`` (e.g. ``"gloo:all_reduce"``; ``dist.barrier()`` is ``"gloo:barrier"`` with no
sizes), ``input_sizes``, ``state`` (always ``"scheduled"`` on gloo), ``retired`` (true once
completed), ``time_created_ns``; ``frames`` is absent. Before ``init_process_group``
``pg_status`` is ``{}``, and so it stays with the recorder off (``TORCH_FR_BUFFER_SIZE=0``).
Older torch has no such function.

Reading an entry needs the whole recorder (85-300 ms with its default 2,000 entries) while the
counters cost 0.1 ms, so :class:`FlightRecorder` reads entries only for a group whose collective
in flight made no progress since the previous look. Standard library only, Python 3.8+: the
sidecar folder carries a copy (:mod:`orchestrate.diagnosis.rankpackage`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from orchestrate.diagnosis.diagfiles import GroupState, InFlight, pg_order

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def dump_function() -> Any:
    """torch's ``_dump_fr_trace_json`` once the program imported torch.distributed, else None."""
    if "torch.distributed" not in sys.modules:
        return None
    torch = sys.modules.get("torch")
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    return getattr(c10d, "_dump_fr_trace_json", None)


class FlightRecorder:
    """One rank's reader; :attr:`note` says why the last read found nothing (``"off"``: torch
    .distributed not imported, ``"unavailable"``: no recorder in this torch, ``"empty"``: the
    recorder is off, ``"error: ..."``), or ``"ok"``."""

    def __init__(self) -> None:
        self.note = "off"
        self._statuses: dict[str, tuple[int, int]] = {}  # pg -> (enqueued, completed) last look
        self._ops: dict[tuple[str, int], InFlight] = {}  # (pg, seq) -> its entry

    def groups(self, initialised: bool, look_up_ops: bool = True
               ) -> tuple[GroupState, ...] | None:
        """Each process group's counters now, with the op of a collective in flight once it
        stalled for a look (None: no recorder to read). ``initialised``: whether the process
        group ever was (an empty status after that means the recorder is off)."""
        dump = dump_function()
        if dump is None:
            self.note = "off" if "torch.distributed" not in sys.modules else "unavailable"
            return None
        try:
            status = json.loads(dump(False, None)).get("pg_status") or {}
            counts = []
            suspects = []
            for name in sorted(status, key=pg_order):
                fields = status[name]
                group = GroupState(
                    str(name), int(fields.get("last_enqueued_collective", -1)),
                    int(fields.get("last_started_collective", -1)),
                    int(fields.get("last_completed_collective", -1)),
                )
                pair = (group.enqueued, group.completed)
                if group.enqueued > group.completed and self._statuses.get(name) == pair \
                        and (name, group.enqueued) not in self._ops:
                    suspects.append((name, group.enqueued))
                self._statuses[name] = pair
                counts.append(group)
            if suspects and look_up_ops:
                self._ops.update(ops_of(json.loads(dump(True, True)), suspects))
            pgs = tuple(
                replace(g, in_flight=self._ops.get((g.pg, g.enqueued)))
                if g.enqueued > g.completed else g for g in counts
            )
            if len(self._ops) > 64:  # keep only what can still be current
                keep = {(p.pg, p.enqueued) for p in pgs}
                self._ops = {k: v for k, v in self._ops.items() if k in keep}
            self.note = "ok" if pgs or not initialised else "empty"
            return pgs
        except Exception as exc:
            self.note = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            return None


def ops_of(dump: dict[str, Any], wanted: list[tuple[str, int]]) -> dict[tuple[str, int], InFlight]:
    """The flight-recorder entry of each wanted ``(group, seq)``: op, state, since, sizes."""
    found: dict[tuple[str, int], InFlight] = {}
    want = set(wanted)
    for entry in dump.get("entries") or []:
        group = entry.get("process_group") or [entry.get("pg_id"), ""]
        key = (str(group[0]), int(entry.get("collective_seq_id", -1)))
        if key not in want or entry.get("is_p2p"):
            continue
        created = entry.get("time_created_ns") or 0
        found[key] = InFlight(
            seq=key[1], op=str(entry.get("profiling_name", "")).split(":", 1)[-1],
            desc=str(group[1]) if len(group) > 1 else "", state=entry.get("state"),
            since=created / 1e9 if created else None, sizes=entry.get("input_sizes"),
        )
    return found


def with_ops(pgs: tuple[GroupState, ...] | None, raw: bytes) -> tuple[GroupState, ...] | None:
    """``pgs`` with the op of each group's collective in flight, from a full dump (``raw``)."""
    wanted = [(p.pg, p.enqueued) for p in pgs or () if p.enqueued > p.completed]
    if not wanted:
        return pgs
    try:
        ops = ops_of(json.loads(raw), wanted)
    except Exception:
        return pgs
    return tuple(replace(p, in_flight=ops.get((p.pg, p.enqueued), p.in_flight))
                 for p in pgs or ())
