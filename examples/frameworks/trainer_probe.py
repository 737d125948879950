"""The Lightning Trainer under orchestrate: ``fit`` for a few steps on a tiny model, then one
JSON line per rank with what the Trainer believes (ranks, world size, cluster environment, its
DistributedSampler) next to what orchestrate set. Run it with
``orchestrate submit examples/frameworks/trainer.yaml --follow``.

What a Trainer needs under orchestrate (docs/frameworks.md): devices = LOCAL_WORLD_SIZE and
num_nodes = the plan's node count, on nodes that all run the same number of ranks (the plan
refuses other layouts for ``framework: lightning-trainer``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from report import end_process_group, lightning_args, report, timeout_s
from torch.utils.data import DataLoader, TensorDataset

STEPS = 4


class Probe(LightningModule):
    """A linear layer on fixed random data; the Trainer adds its own DistributedSampler."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)),
                             torch.randn(64, 1, generator=torch.Generator().manual_seed(1)))
        return DataLoader(data, batch_size=4)


def main() -> None:
    trainer = Trainer(
        strategy=DDPStrategy(timeout=timedelta(seconds=timeout_s())),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **lightning_args(),
    )
    model = Probe()
    trainer.fit(model)
    sampler = trainer.train_dataloader.sampler  # type: ignore[union-attr]
    strategy = trainer.strategy
    # Ranks saw different batches: equal parameters mean DDP averaged the gradients.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = strategy.all_gather(flat)
    total = strategy.reduce(torch.tensor([float(trainer.global_rank + 1)]), reduce_op="sum")
    world = trainer.world_size
    report(
        "trainer",
        {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": world,
            "cluster_environment": type(strategy.cluster_environment).__name__,  # type: ignore[attr-defined]
            "device": str(strategy.root_device),
        },
        {
            "steps": trainer.global_step,
            "all_reduce": total.item(),
            "expected": world * (world + 1) / 2,
            "replicas_agree": bool(torch.allclose(replicas, replicas[0].expand_as(replicas))),
            "sampler": [getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)],
        },
    )


if __name__ == "__main__":
    main()
    end_process_group()  # after main: its model is gone (report.py says why)
