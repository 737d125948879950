"""orchestrate: launch PyTorch DDP training on Slurm, bare SSH servers, or this machine.

The pure core turns an inventory and a job file into a :class:`~orchestrate.plan.Plan`
(:mod:`orchestrate.plan`) and scripts (:mod:`orchestrate.render`); the backends run them.
"""

__version__ = "0.1.0"
