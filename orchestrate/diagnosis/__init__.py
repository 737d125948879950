"""Stall diagnosis: heartbeat -> evidence -> rule -> classifier -> ``diagnosis.json``.

In every rank: :mod:`.activation` (the sidecar folder's ``sitecustomize``, see
:mod:`.rankpackage`) starts :mod:`.sidecar`, which writes the records of :mod:`.diagfiles`
(with :mod:`.flightrecorder`'s counters). Beside the job: :mod:`.evidence` reads heartbeats and
dump answers, :mod:`.stallrule` decides when a job is stuck, :mod:`.stall` classifies who it
waits for (:mod:`.stacks` finds where each rank is), :mod:`.ranktable` is ``orchestrate
diagnose``'s table, and :mod:`.hangwatch` runs the watch beside a job on every backend.
"""
