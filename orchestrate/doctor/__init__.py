"""``orchestrate doctor``: a derived job that checks a cluster tier by tier, and grades it.

:mod:`.run` derives and runs the job, :mod:`.checkup` is its rank program
(``python -m orchestrate.doctor.checkup``), :mod:`.grading` (rows, smoke, connect, culprits),
:mod:`.bandwidth` and :mod:`.floors` judge the figures, :mod:`.findings` names what is wrong,
:mod:`.static_tier` checks node facts and :mod:`.page` draws the report section.
"""
