"""The checkup with nccl on this machine's GPUs (skipped, with the reason, where there are none).

What a user checks: smoke passes with nccl (every GPU joins, the all_reduce is right) and the
bandwidth tier reports the NVLink/PCIe busbw of the GPUs, graded against the inventory's floor
when the model and link are known.
"""

from __future__ import annotations

import pytest

from orchestrate.doctor.checkup.result import CheckupResult
from tests.support.checkupranks import Starter
from tests.support.gpus import GPUS, needs_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.timeout(300)]


@needs_gpu("the nccl checkup needs one")
def test_nccl_smoke_and_bandwidth_on_the_gpus(starter: Starter) -> None:
    visible = ",".join(str(i) for i in range(GPUS))
    checkup = starter.start(
        [GPUS], ["--tier", "bandwidth", "--sizes", "1M,64M,256M,1G", "--budget-s", "1"],
        env={"CUDA_VISIBLE_DEVICES": visible, "ORCHESTRATE_DIST_BACKEND": "nccl",
             "NCCL_SOCKET_IFNAME": "lo"},
    )
    codes = checkup.wait(240)
    assert set(codes.values()) == {0}, checkup.logs()
    result = CheckupResult.from_json(checkup.result())
    assert result.backend == "nccl" and result.ok
    assert [r["device"].split()[0] for r in result.ranks] == [f"cuda:{i}" for i in range(GPUS)]
    world = result.world
    assert world is not None and [s.bytes for s in world.sizes] == [
        1 << 20, 64 << 20, 256 << 20, 1 << 30]
    print(f"\n{GPUS} GPU(s) ({result.ranks[0]['device']}), nccl {result.ranks[0]['nccl']}:")
    for size in world.sizes:
        print(f"  {size.bytes >> 20:>5} MiB: algbw {size.algbw_GBps:8.2f} GB/s, busbw "
              f"{size.busbw_GBps:8.2f} GB/s, {size.iters} iters")
    best = world.best()
    assert best is not None
    if GPUS >= 2:
        # Even PCIe Gen3 moves several GB/s between two GPUs; NVLink moves 100s.
        assert best.busbw_GBps > 2.0, best
    else:
        assert world.sizes[-1].algbw_GBps > 1.0, "one rank: an in-place all_reduce is a copy"
