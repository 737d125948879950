"""The two input files as frozen, typed specs: one door for YAML (line numbers, did-you-mean).

:mod:`.loader` reads YAML safely, :mod:`.job` and :mod:`.inventory` are the specs (with the
trainer's section in :mod:`.trainspec`), :mod:`.hostlist` expands Slurm hostlists and
:mod:`.frameworks` names the training frameworks a ``command:`` may use.
"""
