"""The user code of the jobs that check which rank a failure names (issue #33 item 3): rank 0
explains the failure and then ends last (it lingers 1.5 s at exit), so rank 1, which says
nothing, ends first. Written into a job's workdir as ``nanmodel.py``."""

from __future__ import annotations

#: The workdir module: a model whose weights are NaN (the loss is NaN at the first step), a
#: small dataset, and rank 0 slow to exit (it explains, and ends 1.5 s after rank 1: well inside
#: the supervisor's 3 s for a rank that explains, on a busy machine too).
PROGRAM = """
import atexit, os, time
import torch
from torch.utils.data import TensorDataset

if os.environ.get("RANK") == "0":
    atexit.register(time.sleep, 1.5)


def build_model(hidden=2):
    model = torch.nn.Linear(8, hidden)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    return model


def build_zero():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def build_dataset():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    return data, None
"""
