"""The planner: which nodes, GPUs and ports a job gets, every rank and its environment.

:mod:`.placement` (nodes and GPUs, around what others hold) -> :mod:`.ranks` (numbering) ->
:mod:`.rankenv` (the torchrun contract) -> :mod:`.plan` (the typed :class:`~.plan.Plan`). The run
rules shipped to nodes beside it: :mod:`.outcome` (how a job ended) and :mod:`.restart`.
"""
