"""Hugging Face accelerate under orchestrate: a few DDP steps on a tiny model, then one JSON line
per rank with what accelerate believes (process index, local index, number of processes,
distributed type) next to what orchestrate set. Run it with
``orchestrate submit examples/frameworks/accelerate.yaml --follow``.

accelerate reads the torchrun variables orchestrate sets, so the program passes nothing; on
CPU-only plans orchestrate also sets ACCELERATE_USE_CPU (docs/frameworks.md says why).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from report import end_process_group, report, timeout_s
from torch.utils.data import DataLoader, TensorDataset

STEPS = 4


def main() -> None:
    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s()))]
    )
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)),
                         torch.randn(64, 1, generator=torch.Generator().manual_seed(1)))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer,
                                                   DataLoader(data, batch_size=4))
    steps = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        steps += 1
        if steps == STEPS:
            break
    # Ranks saw different batches: equal parameters mean DDP averaged the gradients.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0)
    replicas = accelerator.gather(flat)
    one = torch.tensor([float(accelerator.process_index + 1)], device=accelerator.device)
    total = accelerator.reduce(one, reduction="sum")
    world = accelerator.num_processes
    report(
        "accelerate",
        {
            "global_rank": accelerator.process_index,
            "local_rank": accelerator.local_process_index,
            "node_rank": None,  # accelerate has no notion of a node index
            "world_size": world,
            "distributed_type": str(accelerator.distributed_type),
            "device": str(accelerator.device),
        },
        {
            "steps": steps,
            "all_reduce": total.item(),
            "expected": world * (world + 1) / 2,
            "replicas_agree": bool(torch.allclose(replicas, replicas[0].expand_as(replicas))),
        },
    )


if __name__ == "__main__":
    main()
    end_process_group()  # after main: its model is gone (report.py says why)
