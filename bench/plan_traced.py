"""Planning a 7 B-shaped model with the traced memory estimate: wall time and host memory.

Writes a job for a LLaMA-7B-shaped stack (32 blocks of width 4096: four 4096x4096 attention
projections and a 4096 -> 11008 -> 4096 gated MLP each, 6.5e9 parameters) on the README's mixed
server (inventory/lab.yaml, ambers, 8 GPUs, ``strategy: auto``, bf16-mixed, batch 1 of 512
tokens, ``memory_trace_s: 600`` so that a loaded machine measures the tracing, not the
deadline), runs ``orchestrate plan --json`` on it as a user does, and reports the command's wall
time, the peak resident memory of its processes (the CLI and the model probe), the chosen
strategy and every layout's traced peak. Targets (issue #24): under 30 s and 2 GB; issue #34:
every layout traced in under 20 s, and a second ``plan`` of the same job (the trace cache,
orchestrate/train/tracecache.py, in a fresh state directory per repeat) under 2 s.

    python bench/plan_traced.py [--repeats 3] [--json out.json]

Run from an older checkout (no trace cache) the second plan traces again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

MODEL = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, width=4096, hidden=11008):
        super().__init__()
        self.norm1 = nn.RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.norm2 = nn.RMSNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, t, c = q.shape
        q, k, v = (z.view(b, t, 32, c // 32).transpose(1, 2) for z in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab=32000, width=4096, depth=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).flatten(0, 1)


def build():
    return Llama()


def loss(output, target):
    return nn.functional.cross_entropy(output, target.flatten())


def data():
    tokens = torch.randint(0, 32000, (8, 512))
    return TensorDataset(tokens, tokens), None
'''

JOB = """name: llama7b
backend: ssh
inventory: lab.yaml
resources: {nodes: 1, node_names: [ambers], gpus_per_node: 8, allow_mixed_gpus: true}
train:
  model: llama7b:build
  dataset: llama7b:data
  loss: llama7b:loss
  strategy: auto
  precision: bf16-mixed
  batch_size: 1
  memory_trace_s: 600
"""


def _once(folder: Path, home: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(folder)])
    env["ORCHESTRATE_HOME"] = str(home)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrate", "plan", "job.yaml", "--json"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    memory = json.loads(done.stdout)["memory"]
    return {"seconds": round(seconds, 2), "max_rss_mb": round(max(peak_kib, before) / 1024),
            "strategy": memory["strategy"], "notes": memory.get("notes", []),
            "estimates": [(e["strategy"], e["gpu_model"], e["peak_gb"], e["method"])
                          for e in memory["estimates"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "llama7b.py").write_text(MODEL)
        (folder / "job.yaml").write_text(JOB)
        (folder / "lab.yaml").write_text((REPO / "inventory" / "lab.yaml").read_text())
        print(f"load average {os.getloadavg()[0]:.1f}")
        runs, again = [], []
        for repeat in range(args.repeats):
            home = folder / f"state-{repeat}"
            runs.append(_once(folder, home))
            again.append(_once(folder, home))
    for run, second in zip(runs, again, strict=True):
        print(f"{run['seconds']:6.2f} s  max RSS {run['max_rss_mb']} MB  -> {run['strategy']}; "
              f"again {second['seconds']:.2f} s")
    for row in runs[-1]["estimates"]:
        print("  {:8} {:10} {:8.2f} GB  {}".format(*row))
    for note in runs[-1]["notes"]:
        print(f"  note: {note}")
    summary = {"median_s": statistics.median(r["seconds"] for r in runs),
               "again_median_s": statistics.median(r["seconds"] for r in again),
               "max_rss_mb": max(r["max_rss_mb"] for r in runs), "runs": runs, "again": again}
    print(f"median {summary['median_s']:.2f} s (target < 20 s), again (cached) "
          f"{summary['again_median_s']:.2f} s (target < 2 s), max RSS "
          f"{summary['max_rss_mb']} MB (target < 2048 MB)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
