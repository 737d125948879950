"""busbw of the doctor's bandwidth tier against a minimal hand-written all_reduce timing loop.

The tool must measure the link, not itself: on the same ranks, sizes and iteration counts,
``python -m orchestrate.doctor.checkup --tier bandwidth`` (A) and the loop below (B) should report
the same all_reduce bus bandwidth. The hand loop is the textbook one (stas00's all_reduce_bench,
nccl-tests -z 1): per size, warm-up all_reduces, then for each timed iteration a barrier and
one blocking all_reduce timed on its own (CUDA events on GPUs, perf_counter on CPUs); a rank's
figure is its mean time, the job's the mean over ranks; busbw = bytes / time * 2 (n-1) / n.
The checkup runs with ``--budget-s 0`` so its iteration counts are exactly the loop's.

Runs alternate A B, B A, A B ... (each a fresh set of rank processes) so that drift in the
machine's load hits both alike; per size the result is the median of each side and their ratio
(target 0.9-1.1).

    python bench/doctor_bandwidth.py [--ranks N] [--sizes 1M,16M,64M,256M] [--repeats 5]
                                     [--warmup 5] [--iters 10] [--json out.json]

On CPUs: N gloo ranks on loopback (default 2). On a GPU machine the same command runs nccl with
one rank per GPU (all of them by default); with a single GPU there is one rank, busbw is 0 by
definition, and algbw is compared instead.
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CPU_SIZES = "1M,16M,64M,256M"
GPU_SIZES = "1M,16M,256M,1G"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gpus() -> int:
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, timeout=120,
    )
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def _launch(argv: list[str], ranks: int, logs: Path, timeout: float) -> None:
    """Run ``argv`` as ``ranks`` ranks of one node with the torchrun environment."""
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")}
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        log = open(logs / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT),
                      log))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    bad = [p.returncode for p, _ in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"ranks failed ({bad}); logs in {logs}:\n"
                         + (logs / "rank0.log").read_text(errors="replace")[-3000:])


def _checkup(args: argparse.Namespace, ranks: int, work: Path) -> dict[int, dict[str, float]]:
    out = work / "checkup.json"
    _launch([sys.executable, "-m", "orchestrate.doctor.checkup", "--tier", "bandwidth",
             "--sizes", args.sizes, "--warmup", str(args.warmup), "--iters", str(args.iters),
             "--budget-s", "0", "--timeout-s", "120", "--out", str(out)],
            ranks, work, args.timeout)
    data = json.loads(out.read_text())
    return {int(s["bytes"]): {"busbw": float(s["busbw_GBps"]), "algbw": float(s["algbw_GBps"])}
            for s in data["bandwidth"]["all_reduce"]["sizes"]}


def _hand(args: argparse.Namespace, ranks: int, work: Path) -> dict[int, dict[str, float]]:
    out = work / "hand.json"
    _launch([sys.executable, str(Path(__file__).resolve()), "--hand-loop", "--sizes",
             args.sizes, "--warmup", str(args.warmup), "--iters", str(args.iters),
             "--json", str(out)], ranks, work, args.timeout)
    data = json.loads(out.read_text())
    return {int(k): v for k, v in data.items()}


def hand_loop(sizes: list[int], warmup: int, iters: int, out: Path) -> None:
    """The minimal loop, run in each rank (``--hand-loop``)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    results: dict[int, dict[str, float]] = {}
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.barrier()
            dist.all_reduce(tensor)
        times = []
        for _ in range(iters):
            dist.barrier()
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(tensor)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                began = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - began)
        mean = torch.tensor([sum(times) / len(times)], dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        seconds = float(mean.item()) / world
        algbw = nbytes / seconds / 1e9
        results[nbytes] = {"algbw": algbw, "busbw": algbw * 2 * (world - 1) / world}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=0)
    parser.add_argument("--sizes", default="")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hand-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from orchestrate.doctor.checkup.options import human, parse_size

    if args.hand_loop:
        hand_loop([parse_size(s) for s in args.sizes.split(",")], args.warmup, args.iters,
                  args.json)
        return
    gpus = _gpus()
    ranks = args.ranks or (gpus if gpus else 2)
    args.sizes = args.sizes or (GPU_SIZES if gpus else CPU_SIZES)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    metric = "busbw" if ranks > 1 else "algbw"
    backend = "nccl" if gpus else "gloo"
    print(f"{ranks} {backend} rank(s), sizes {args.sizes}, warmup {args.warmup}, iters "
          f"{args.iters}, {args.repeats} repeats; load average {_load()}", flush=True)
    runs: dict[str, list[dict[int, dict[str, float]]]] = {"checkup": [], "hand": []}
    with tempfile.TemporaryDirectory(prefix="doctor-bench-") as tmp:
        for repeat in range(args.repeats):
            order = ("checkup", "hand") if repeat % 2 == 0 else ("hand", "checkup")
            for side in order:
                work = Path(tmp) / f"{side}-{repeat}"
                work.mkdir()
                runner = _checkup if side == "checkup" else _hand
                runs[side].append(runner(args, ranks, work))
            print(f"  repeat {repeat + 1}: " + ", ".join(
                f"{human(n)} {runs['checkup'][-1][n][metric]:.3f}/{runs['hand'][-1][n][metric]:.3f}"
                for n in sizes), flush=True)
    table: list[dict[str, Any]] = []
    print(f"\n{'size':>8}  {'checkup ' + metric:>16}  {'hand ' + metric:>14}  ratio")
    for nbytes in sizes:
        a = statistics.median(r[nbytes][metric] for r in runs["checkup"])
        b = statistics.median(r[nbytes][metric] for r in runs["hand"])
        ratio = a / b if b > 0 else float("nan")
        table.append({"bytes": nbytes, f"checkup_{metric}_GBps": a, f"hand_{metric}_GBps": b,
                      "ratio": ratio})
        print(f"{human(nbytes):>8}  {a:>11.3f} GB/s  {b:>9.3f} GB/s  {ratio:.3f}")
    print(f"load average after: {_load()}")
    if args.json:
        args.json.write_text(json.dumps({"ranks": ranks, "backend": backend, "metric": metric,
                                         "repeats": args.repeats, "sizes": table}, indent=1))


if __name__ == "__main__":
    main()
