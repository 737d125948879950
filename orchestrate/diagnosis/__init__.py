"""Stall diagnosis: heartbeat -> evidence -> rule -> classifier -> ``diagnosis.json``.

:mod:`.sidecar` runs inside every rank (loaded as ``sitecustomize``, standard library only),
:mod:`.evidence` reads heartbeats and dump answers, :mod:`.stall` holds the rule and the
classifier, :mod:`.hangwatch` runs the watch beside a job on every backend.
"""
