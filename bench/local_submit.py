"""Wall time of ``orchestrate submit --follow`` against ``torchrun --standalone`` (issue 4).

Both run the same trivial 2-rank DDP program (init, one all-reduce, exit) on this machine; runs
are interleaved (A B A B ...) so that machine noise hits both alike. Prints medians and the
ratio; target: orchestrate / torchrun <= 1.10.

    python bench/local_submit.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidebyside import TRIVIAL_DDP, compare

JOB = """
name: trivial
resources: {nodes: 1, gpus_per_node: 2}
command: [python, prog.py]
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-local-"))
    (work / "prog.py").write_text(TRIVIAL_DDP)
    (work / "job.yaml").write_text(JOB)
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), ORCHESTRATE_RUNS=str(work / "runs"),
               OMP_NUM_THREADS="1")
    ours = [sys.executable, "-m", "orchestrate", "submit", "job.yaml", "--follow"]
    theirs = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "prog.py"]
    ratio = compare(("orchestrate submit --follow", ours), ("torchrun --standalone", theirs),
                    args.runs, work, env)
    print(f"ratio orchestrate/torchrun    {ratio:.3f}  (target <= 1.10)")

if __name__ == "__main__":
    main()
