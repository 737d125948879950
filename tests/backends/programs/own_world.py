"""A program that trains alone while it looks distributed (issue #33, item 7), and ends at once:
its world lives well under the join watch's one-second look.

``MODE=alone``: every rank forms a world of 1 of its own (a file store per rank) and exits.
``MODE=reinit``: every rank joins the plan's world (the environment), then destroys it and
forms a world of 1 alone, as a program that "re-initialises" for evaluation might."""

from __future__ import annotations

import os

import torch.distributed as dist


def main() -> None:
    store = os.path.join(os.environ["OUT"], f"store-{os.environ['RANK']}")
    os.makedirs(os.environ["OUT"], exist_ok=True)
    if os.environ["MODE"] == "reinit":
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
