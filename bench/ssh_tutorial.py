"""The DDP tutorial-series program on 2 SSH test hosts x 2 ranks: under orchestrate
(``launcher: torchrun``, and ``launcher: ranks``) against torchrun started by hand over ssh on
each host, side by side (issue #37).

The program is a short equivalent of pytorch/examples' ``multigpu_torchrun.py`` (written here,
not downloaded): a Linear(20, 1) model under DDP, a 2048-sample random dataset split by a
DistributedSampler, batches of 32, SGD, a few epochs, rank 0 saving a snapshot every few
epochs; gloo on CPU, ``init_process_group()`` from torchrun's environment. Each rank prints
``tutorial-start <time>`` once its process group is up and ``tutorial-end <time>`` before it
exits (one machine, one clock), so every side splits into *start* (the command to the first
rank's start line), *run* (first start to last end) and *end* (last end to the command's exit).

By hand is what a person types: ``ssh h1 python -m torch.distributed.run --nnodes 2
--node-rank 0 --master-addr <h1> ... prog.py &``, the same on h2, both waited for. orchestrate
is ``orchestrate submit job.yaml --follow`` (its rank lines come through the CLI; the job has
no ``restart:``, so the default policy, as a user's would). Runs are
interleaved (by hand, torchrun, ranks, ...), one warm-up of each first; medians.

    flock /tmp/bench.lock flock /tmp/ssh-tests.lock python bench/ssh_tutorial.py [--runs 3]
        [--epochs 20] [--checkout DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from testbeds import SSH_STATE, ssh_hosts, ssh_hosts_down, ssh_hosts_up, ssh_settings

#: multigpu_torchrun.py's shape, on CPU with gloo.
PROGRAM = '''
import os, sys, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot = snapshot

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                torch.save({"MODEL_STATE": self.model.module.state_dict(),
                            "EPOCHS_RUN": epoch}, self.snapshot)


def main():
    os.makedirs(os.environ["OUT"], exist_ok=True)
    dist.init_process_group("gloo")
    print(f"tutorial-start {time.time():.6f}", flush=True)
    torch.manual_seed(0)
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=32, shuffle=False, sampler=DistributedSampler(dataset))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    snapshot = os.path.join(os.environ["OUT"], f"snapshot-{run_id}.pt")
    Trainer(model, loader, optimizer, 5, snapshot).train(int(os.environ["EPOCHS"]))
    dist.destroy_process_group()
    print(f"tutorial-end {time.time():.6f}", flush=True)


if __name__ == "__main__":
    main()
'''

JOB = """\
name: tutorial-{launcher}
inventory: inventory.yaml
backend: ssh
launcher: {launcher}
resources: {{nodes: 2, gpus_per_node: 2}}
distributed: {{backend: gloo}}
env: {{OUT: '{out}', EPOCHS: {epochs}, OMP_NUM_THREADS: 1}}
command: [python3, prog.py]
"""


def marks(text: str) -> tuple[float, float]:
    """The first rank's start and the last rank's end, from the program's lines (two ranks
    of one torchrun may print into one line)."""
    found = re.findall(r"tutorial-(start|end) (\d+\.\d+)", text)
    starts = [float(stamp) for what, stamp in found if what == "start"]
    ends = [float(stamp) for what, stamp in found if what == "end"]
    if len(starts) != 4 or len(ends) != 4:
        raise SystemExit(f"expected 4 start and 4 end lines, got:\n{text[-3000:]}")
    return min(starts), max(ends)


def by_hand(work: Path, env: dict[str, str], epochs: int, index: int) -> tuple[float, ...]:
    """torchrun by hand: one ``ssh host torchrun ...`` per host, started together, waited for."""
    hosts = ssh_hosts(2)
    master = hosts[0][1]
    port = random.randint(20000, 29999)  # not the port of a run that a killed bench left
    procs = []
    t0 = time.time()
    for node_rank, (host, _) in enumerate(hosts):
        line = (f"cd {work} && OUT={work}/out-hand EPOCHS={epochs} OMP_NUM_THREADS=1 "
                f"exec {sys.executable} -m torch.distributed.run --nnodes=2 "
                f"--node-rank={node_rank} --nproc-per-node=2 --master-addr={master} "
                f"--master-port={port} --rdzv-id=hand-{index} prog.py")
        procs.append(subprocess.Popen(
            ["ssh", "-F", str(SSH_STATE / "ssh_config"), host, line], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [p.communicate()[0] for p in procs]
    t1 = time.time()
    if any(p.returncode for p in procs):
        raise SystemExit("torchrun by hand failed:\n" + "\n".join(outputs))
    return split(t0, t1, "\n".join(outputs))


def orchestrate(work: Path, env: dict[str, str], launcher: str) -> tuple[float, ...]:
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "orchestrate", "submit", f"{launcher}.yaml",
                           "--follow"], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, check=False)
    t1 = time.time()
    if done.returncode != 0:
        raise SystemExit(f"orchestrate ({launcher}) failed:\n{done.stdout}\n{done.stderr}")
    return split(t0, t1, done.stdout)


def split(t0: float, t1: float, text: str) -> tuple[float, float, float, float]:
    """(whole, start, run, end) seconds of one run."""
    first, last = marks(text)
    return t1 - t0, first - t0, last - first, t1 - last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]),
                        help="the orchestrate checkout put first on PYTHONPATH")
    args = parser.parse_args()
    started = ssh_hosts_up(2)
    try:
        work = Path(tempfile.mkdtemp(prefix="bench-tutorial-"))
        (work / "prog.py").write_text(PROGRAM)
        inventory = {"name": "bench", "defaults": {"python": sys.executable,
                                                   "ssh": ssh_settings()},
                     "nodes": [{"name": n, "address": a, "slots": 2} for n, a in ssh_hosts(2)]}
        (work / "inventory.yaml").write_text(json.dumps(inventory))
        for launcher in ("torchrun", "ranks"):
            (work / f"{launcher}.yaml").write_text(JOB.format(
                launcher=launcher, out=work / f"out-{launcher}", epochs=args.epochs))
        env = dict(os.environ, PYTHONPATH=args.checkout, ORCHESTRATE_HOME=str(work / "home"),
                   ORCHESTRATE_RUNS=str(work / "runs"))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.pop("ORCHESTRATE_JOB_ID", None)
        sides = {"torchrun by hand over ssh": lambda i: by_hand(work, env, args.epochs, i),
                 "orchestrate, launcher: torchrun": lambda i: orchestrate(work, env, "torchrun"),
                 "orchestrate, launcher: ranks": lambda i: orchestrate(work, env, "ranks")}
        times: dict[str, list[tuple[float, ...]]] = {k: [] for k in sides}
        for run in sides.values():  # warm the page cache and the .pyc files
            run(0)
        for i in range(1, args.runs + 1):
            for label, run in sides.items():
                times[label].append(run(i))
        report(times, args)
    finally:
        if started:
            ssh_hosts_down()


def report(times: dict[str, list[tuple[float, ...]]], args: argparse.Namespace) -> None:
    print(f"{args.runs} runs each (interleaved), {args.epochs} epochs; load average "
          f"{os.getloadavg()[0]:.1f}; checkout {args.checkout}")
    hand = statistics.median(t[0] for t in times["torchrun by hand over ssh"])
    for label, rows in times.items():
        whole, start, run, end = (statistics.median(r[k] for r in rows) for k in range(4))
        print(f"{label:<32} {whole:6.2f} s ({whole / hand:.2f}x)  start {start:.2f}  "
              f"run {run:.2f}  end {end:.2f}   each: "
              + ", ".join(f"{r[0]:.2f}" for r in rows))


if __name__ == "__main__":
    main()
