"""A plan as scripts: Jinja templates that lay values out, every value shell-quoted.

:mod:`.render` holds the environment, the quoting filters and the per-node script;
:mod:`.allocation` turns a plan into one Slurm job's layout. Backends name the files they
submit (``Backend.files``); this package knows no backend.
"""
