"""Lightning Fabric under orchestrate: a few DDP steps on a tiny model, then one JSON line per
rank with what Fabric believes (ranks, world size, cluster environment) next to what orchestrate
set. Run it with ``orchestrate submit examples/frameworks/fabric.yaml --follow``.

What a Fabric program needs under orchestrate (docs/frameworks.md): devices = LOCAL_WORLD_SIZE
and num_nodes = the plan's node count, and on nodes with different rank counts (Slurm only) a
DistributedSampler sized by ``fabric.world_size`` instead of Fabric's own.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from report import end_process_group, lightning_args, report, timeout_s
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS = 4


def main() -> None:
    fabric = Fabric(strategy=DDPStrategy(timeout=timedelta(seconds=timeout_s())),
                    **lightning_args())
    fabric.launch()  # starts nothing: orchestrate started every rank (LOCAL_RANK is set)
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)),
                         torch.randn(64, 1, generator=torch.Generator().manual_seed(1)))
    sampler = DistributedSampler(data, num_replicas=fabric.world_size, rank=fabric.global_rank,
                                 shuffle=False)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, sampler=sampler),
                                      use_distributed_sampler=False)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    steps = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        steps += 1
        if steps == STEPS:
            break
    # Ranks saw different batches: equal parameters mean DDP averaged the gradients.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = fabric.all_gather(flat)
    total = fabric.all_reduce(torch.tensor([float(fabric.global_rank + 1)]), reduce_op="sum")
    world = fabric.world_size
    report(
        "fabric",
        {
            "global_rank": fabric.global_rank,
            "local_rank": fabric.local_rank,
            "node_rank": fabric.node_rank,
            "world_size": world,
            "cluster_environment": type(fabric.strategy.cluster_environment).__name__,
            "device": str(fabric.device),
        },
        {
            "steps": steps,
            "all_reduce": total.item(),
            "expected": world * (world + 1) / 2,
            "replicas_agree": bool(torch.allclose(replicas, replicas[0].expand_as(replicas))),
            "sampler": [sampler.num_replicas, sampler.rank],
        },
    )


if __name__ == "__main__":
    main()
    end_process_group()  # after main: its model is gone (report.py says why)
