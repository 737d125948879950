"""The pure core: job and inventory files in, a plan and its scripts out.

No process, socket, clock or randomness: values in, values out. :mod:`.spec` is the one door
the two files come in through, :mod:`.plan` the planner, :mod:`.render` the templates;
:mod:`.errors`, :mod:`.exits` and :mod:`.layout` are the leaves everything uses.
"""
