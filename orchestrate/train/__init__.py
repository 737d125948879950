"""Run a DDP training job on every rank; see :mod:`orchestrate.train.main`."""
