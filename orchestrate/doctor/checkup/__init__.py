"""The checkup: the doctor's rank program, run on every planned rank with the plan's environment.

``python -m orchestrate.doctor.checkup [--tier static|connect|smoke|bandwidth|all] [--sizes
32K,1M,...] [--pair-size 16M] [--warmup 5] [--iters 10] [--min-iters 2] [--budget-s 2]
[--join-timeout-s 60] [--timeout-s 20] [--deadline-s S] [--out FILE] [--node-names a,b,...]
[--nodes N] [--connect-window-s 20]``

It reads the torchrun contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, or Slurm's variables), ORCHESTRATE_DIST_BACKEND (nccl on GPUs, gloo
otherwise), ORCHESTRATE_RUN_DIR (where rank 0 writes), CUDA_VISIBLE_DEVICES (each rank uses
``cuda:LOCAL_RANK``) and ORCHESTRATE_NODE_NAMES (node names, comma-separated, in GROUP_RANK
order; without it a node is called ``node <GROUP_RANK>``). Rank 0 hosts the rendezvous store on
MASTER_PORT, exactly as the job will.

The static and connect tiers run on each node's leader (local rank 0) before any process
group: :mod:`~orchestrate.doctor.checkup.leader` (the node's facts, node-to-node ports) and
:mod:`~orchestrate.doctor.checkup.rollcall` (every leader says hello on MASTER_PORT); they print
what they found as marked lines (:mod:`~orchestrate.doctor.checkup.transcript`), which the doctor
judges.
Rank 0's result is printed the same way: the output is what comes back on every backend.

Modules: :mod:`~orchestrate.doctor.checkup.program` (the steps),
:mod:`~orchestrate.doctor.checkup.options` (the tiers, the options, the bounds),
:mod:`~orchestrate.doctor.checkup.failing` (the failure path),
:mod:`~orchestrate.doctor.checkup.measure` (timing), :mod:`~orchestrate.doctor.checkup.control` (the
store protocol and the watchdog),
:mod:`~orchestrate.doctor.checkup.blame` (whom a failure names),
:mod:`~orchestrate.doctor.checkup.schedule` (pair rounds, iteration counts),
:mod:`~orchestrate.doctor.checkup.result` (the value written). Only
program, measure and control import torch (and blame.kind_of, which classifies an error), and
only when run.

The result, ``$ORCHESTRATE_RUN_DIR/checkup.json`` (``--out``), written by rank 0::

    {
      "format": 1,
      "ok": true,                          # false when "failure" is set
      "tiers": ["smoke", "bandwidth"],
      "backend": "gloo",
      "world_size": 4,
      "nodes": ["a", "b"],                 # GROUP_RANK order
      "ranks": [{"rank": 0, "local_rank": 0, "local_world_size": 2, "group_rank": 0,
                 "node": "a", "host": "...", "pid": 123, "device": "cpu",
                 "torch": "2.13.0+cpu", "cuda": null, "nccl": null}, ...],
      "elapsed_s": 7.2,
      "smoke": {"steps_s": {"join": 0.4, "init": 0.1, "monitored_barrier": 0.01,
                            "barrier": 0.001, "all_reduce": 0.02}},
      "bandwidth": null | {
        "all_reduce": {"ranks": 4, "nodes": 2, "sizes": [
            {"bytes": 268435456, "iters": 4, "time_s": 0.41, "time_max_s": 0.43,
             "algbw_GBps": 0.65, "busbw_GBps": 0.98}, ...]},
        "intra_node": {"a": {"ranks": 2, "nodes": 1, "sizes": [...]}, ...},
        "pairs": {"nodes": ["a", "b"], "bytes": 16777216,
                  "GBps": [[null, 1.9], [2.1, null]]}      # row sends to column
      },
      "failure": null | {"tier": "smoke", "step": "all_reduce",
                         "detail": "rank 3 (node b) stopped answering in all_reduce ...",
                         "ranks": [3], "nodes": ["b"],
                         "per_rank": {"0": "all_reduce: ...", "3": "silent in all_reduce"}}
    }

A rank that fails before it can tell rank 0 (it cannot reach the store) writes the same shape
to ``checkup-rank-<R>.json`` beside it. Every rank prints one ``checkup: ...`` line.
"""
