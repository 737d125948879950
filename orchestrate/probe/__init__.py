"""Inventory probing: what a host has, as facts, parsed and folded into inventory files.

Pure or local-only, below the backends: :mod:`.gathering` builds the program that runs on a
host, :mod:`.facts` parses what it printed, :mod:`.inventoryfile` writes and merges files,
:mod:`.drift` compares a file with its machines, and :mod:`.machine` is this machine seen
through the same path. The transports live with their backends.
"""
