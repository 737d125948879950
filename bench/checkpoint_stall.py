"""Time a job loses to its checkpoints: background (``checkpoint_async``) against synchronous.

Two gloo ranks on the CPU (one intra-op thread each) train digits' MLP made wide (``--hidden``
6400: 41 M parameters, 0.49 GB of weights and AdamW moments per rank under DDP) for
``--steps`` optimizer steps, in three variants run interleaved (the order turning each repeat):

- ``none``: no checkpoint before the end;
- ``sync``: a checkpoint every ``--every`` steps, written while every rank waits;
- ``async``: the same checkpoints, copied to host memory and written in the background.

A run's training time is the span between its ``step`` records of step 1 and of the last step
(``log_every_steps: 1``), which leaves out start-up and the final checkpoint (synchronous in all
three). The time lost to checkpoints is a variant's median span minus ``none``'s; the result is
lost(async) / lost(sync) (target <= 0.35 on CPUs, where the copy to host memory is a memory copy
inside the step; ~0.1 on GPUs, where it is a device-to-host transfer). The same ratio is also
given inside each run: a run's span beyond its own median step times its steps, less ``none``'s
(drift between runs, which a busy machine has plenty of, then cancels; drift within one does not).

    python bench/checkpoint_stall.py [--repeats 3] [--hidden 6400] [--steps 80] [--every 8]
                                     [--strategy ddp|fsdp] [--checkpoint-dir DIR] [--json F]

The default span, 80 steps with a checkpoint every 8 (9 checkpoints, one every ~5 s), is long
enough for the steady state to count: the first two background saves pay a one-off (the host
copy's buffers and a second checkpoint file are new memory; from the third on, each save is
written into the file the one before it pruned), which alone decides a span of 2-4 checkpoints.
``--steps 40`` shows that one-off's share.

The background write must fit between two checkpoints, or the next one waits for it (and says
so): on a disk slower than the training (a shared VM's 20 MB/s, 25 s for one 0.5 GB checkpoint)
the async side loses almost as much as the sync one whatever the code does. ``--checkpoint-dir
/dev/shm/...`` stands in for a node's fast local disk and measures what the ranks themselves
pay: serialising and writing against copying.

On a shared machine other tenants' load moves single runs a lot: the load average is printed
before and after, and the variants alternate so that drift hits all three alike.

``--parts`` times, in one process and on the same state, what each path costs the ranks (medians
of ``--repeats``): the copy to host memory as the first save makes it (allocating) and as every
later one does (into the kept buffers), the synchronous write it replaces, the background write's
own CPU time, and the longest the training thread was kept from running Python during that
write (the GIL: torch.save releases it while it writes the tensors); then the same for the
write in shares that the trainer makes under DDP (train/partwrite.py: rank 0's frame, each
rank's copy of its share, and rank 0's write of its share).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
WORLD = 2
VARIANTS = ("none", "sync", "async")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(config: Path, run_dir: Path) -> None:
    """Run the entrypoint as WORLD ranks; raise with the logs unless all exit 0."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", ORCHESTRATE_TIMING="0",
                   ORCHESTRATE_SIDECAR="0", PYTHONPATH=os.pathsep.join([str(REPO), str(DIGITS)]))
        log = open(run_dir.parent / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        argv = [sys.executable, "-m", "orchestrate.train", "--config", str(config),
                "--run-dir", str(run_dir)]
        procs.append((subprocess.Popen(argv, cwd=DIGITS, env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=1200))
        log.close()
    if any(codes):
        logs = [(run_dir.parent / f"rank{rank}.log").read_text()[-2000:] for rank in range(WORLD)]
        raise RuntimeError(f"ranks exited {codes}:\n" + "\n".join(
            f"--- rank {rank}:\n{text}" for rank, text in enumerate(logs)))


def run_once(variant: str, args: argparse.Namespace, work: Path) -> tuple[float, float]:
    """Seconds between the step records of step 1 and of the last step of one run, and how much
    of it is beyond the run's own median step (what its checkpoints cost, measured inside the
    run: a machine whose load drifts between runs moves this much less than the span)."""
    from orchestrate.core.spec.trainspec import TrainSpec

    spec = TrainSpec.model_validate({
        "model": "digits:build_model", "model_args": {"hidden": args.hidden, "dropout": 0.0},
        "dataset": "digits:build_dataset", "epochs": 1000, "max_steps": args.steps,
        "batch_size": 32, "log_every_steps": 1, "keep_checkpoints": 1,
        "strategy": args.strategy,
        "checkpoint_every_steps": 10**9 if variant == "none" else args.every,
        "checkpoint_async": variant == "async",
        "checkpoint_dir": str(args.checkpoint_dir / variant) if args.checkpoint_dir else None,
    })
    run = work / variant
    run.mkdir(parents=True, exist_ok=True)
    config = run / "config.json"
    config.write_text(json.dumps(spec.model_dump(mode="json")))
    run_dir = run / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    _launch(config, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if r["kind"] == "step"}
    subprocess.run(["rm", "-rf", str(run_dir / "checkpoints")], check=True)
    if args.checkpoint_dir is not None:
        subprocess.run(["rm", "-rf", str(args.checkpoint_dir / variant)], check=True)
    span = float(times[args.steps] - times[1])
    median = statistics.median(times[s] - times[s - 1] for s in range(2, args.steps + 1))
    return span, span - median * (args.steps - 1)


def _median_time(action: Any, repeats: int) -> float:
    took = []
    for _ in range(repeats):
        began = time.perf_counter()
        action()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def _background(write: Any) -> tuple[float, float]:
    """Run ``write`` in a thread: its CPU seconds, and the longest gap the training thread saw
    between two of its own Python steps meanwhile."""
    cpu: list[float] = []

    def run() -> None:
        began = time.thread_time()
        write()
        cpu.append(time.thread_time() - began)

    thread = threading.Thread(target=run)
    last = time.perf_counter()
    worst = 0.0
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    thread.join()
    return cpu[0], worst


def _shares(args: argparse.Namespace, model: Any, optimizer: Any, folder: Path,
            partwrite: Any) -> dict[str, float]:
    """The same for a background save written in shares by 2 ranks (train/partwrite.py): the
    frame rank 0 writes in the step, each rank's copy of its share, and rank 0's write of its
    share (its CPU time: what the ranks' cores lose while they train)."""
    copies = [partwrite.PartCopy(), partwrite.PartCopy()]

    def take(rank: int) -> Any:
        return copies[rank].take(model, optimizer, {}, rank=rank, ranks=WORLD)

    shares = [take(0), take(1)]
    step = iter(range(10, 10**6))
    frames: list[Any] = []

    def frame() -> None:
        frames.append(partwrite.start(shares[0], directory=folder, step=next(step), keep=1,
                                      rank=0, group=None))

    figures = {"shares: rank 0's frame (in the step)": _median_time(frame, args.repeats),
               "shares: copy of rank 0's share": _median_time(lambda: take(0), args.repeats),
               "shares: copy of rank 1's share": _median_time(lambda: take(1), args.repeats)}
    cpu = []
    for job in frames:
        began = time.thread_time()
        partwrite.write_share(job.temporary, job.table, shares[0].mine)
        cpu.append(time.thread_time() - began)
        job.temporary.unlink()
    figures["shares: rank 0's write of its share, CPU time"] = statistics.median(cpu)
    return figures


def parts(args: argparse.Namespace) -> dict[str, float]:
    """Seconds of each part of a checkpoint of the bench's model, in this process."""
    import torch

    sys.path[:0] = [str(REPO), str(DIGITS)]
    from digits import build_model  # type: ignore[import-not-found]

    from orchestrate.train import asyncsave, checkpoint, partwrite

    torch.set_num_threads(1)
    model = build_model(hidden=args.hidden, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(32, 64)).sum().backward()
    optimizer.step()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    host = asyncsave.HostCopy()
    host.take(state())
    folder = Path(tempfile.mkdtemp(prefix="parts-", dir=args.checkpoint_dir))
    try:
        copy = host.take(state())
        figures = {
            "copy, allocating (the first save)": _median_time(
                lambda: asyncsave.snapshot(state()), args.repeats),
            "copy into the kept buffers": _median_time(lambda: host.take(state()), args.repeats),
            "synchronous checkpoint.save": _median_time(
                lambda: checkpoint.save(copy, folder, 1, 1), args.repeats),
        }
        background = [_background(lambda: checkpoint.save(copy, folder, 2, 1))
                      for _ in range(args.repeats)]
        figures["background write, its CPU time"] = statistics.median(b[0] for b in background)
        figures["training thread's longest wait for the GIL"] = statistics.median(
            b[1] for b in background)
        figures.update(_shares(args, model, optimizer, folder, partwrite))
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    for label, seconds in figures.items():
        print(f"{label:<45} {seconds:.3f} s", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--hidden", type=int, default=6400, help="width of the MLP")
    parser.add_argument("--steps", type=int, default=80,
                        help="optimizer steps per run (past an epoch's 22 they go on into the "
                        "next epochs, whose ends validate alike in every variant)")
    parser.add_argument("--every", type=int, default=8, help="checkpoint every N steps")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="write the checkpoints under this folder (e.g. /dev/shm: a fast "
                        "disk); default: the run directory, in the system's temporary folder")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--parts", action="store_true",
                        help="time each part of one checkpoint in this process instead")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.parts:
        figures = parts(args)
        print(f"load average after: {os.getloadavg()}")
        if args.json is not None:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0
    params = 64 * args.hidden + args.hidden * args.hidden + args.hidden * 10
    print(f"{params / 1e6:.1f} M parameters: {params * 12 / 1e9:.2f} GB of weights and AdamW "
          f"moments per rank ({args.strategy}); {args.steps} steps, a checkpoint every "
          f"{args.every}", flush=True)
    spans: dict[str, list[float]] = {v: [] for v in VARIANTS}
    excess: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="checkpoint_stall-") as tmp:
        for repeat in range(args.repeats):
            # The order turns each repeat (none sync async, sync async none, ...): a machine
            # whose load drifts during a repeat favours no variant.
            for variant in VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]:
                took, beyond = run_once(variant, args, Path(tmp))
                spans[variant].append(took)
                excess[variant].append(beyond)
                print(f"  run {repeat + 1} {variant:<5} {took:.2f} s ({beyond:.2f} s beyond "
                      "its median step)", flush=True)
    medians = {v: statistics.median(spans[v]) for v in VARIANTS}
    within = {v: statistics.median(excess[v]) - statistics.median(excess["none"])
              for v in ("sync", "async")}
    lost = {v: medians[v] - medians["none"] for v in ("sync", "async")}
    ratio = lost["async"] / lost["sync"] if lost["sync"] > 0 else float("nan")
    for variant in VARIANTS:
        print(f"{variant:<5} median {medians[variant]:.2f} s (min {min(spans[variant]):.2f}, "
              f"max {max(spans[variant]):.2f})")
    print(f"lost to checkpoints: sync {lost['sync']:.2f} s, async {lost['async']:.2f} s; "
          f"async / sync = {ratio:.2f} (target <= 0.35)")
    print(f"inside each run (beyond its median step, less none's): sync {within['sync']:.2f} s, "
          f"async {within['async']:.2f} s; async / sync = {within['async'] / within['sync']:.2f}")
    print(f"load average after: {os.getloadavg()}")
    if args.json is not None:
        given = {k: v if isinstance(v, int | str) else str(v) for k, v in vars(args).items()}
        result: dict[str, Any] = {"spans_s": spans, "medians_s": medians, "lost_s": lost,
                                  "ratio": ratio, "args": given,
                                  "beyond_median_step_s": excess, "within_lost_s": within}
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
