"""Submit-to-running of a 2-rank job in a container against the same job on the host (issue 23).

Both run the same trivial 2-rank DDP program (init, one all-reduce, exit) with
``orchestrate submit --follow`` on this machine (local backend); the container side runs it in
podman with the test image (tests/support/containers.py: built here, this machine's Python
mounted read-only). Runs are interleaved (A B A B ...) so machine noise hits both alike.
Prints medians and the ratio container / host: what a container costs a job's start (creating
the node's container, ``exec`` per rank, removing it at the end).

    python bench/container_submit.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidebyside import TRIVIAL_DDP, compare

from tests.support.containers import container_section

JOB = """
name: {name}
resources: {{nodes: 1, gpus_per_node: 2}}
command: [python, prog.py]
{extra}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-container-"))
    (work / "prog.py").write_text(TRIVIAL_DDP)
    (work / "host.yaml").write_text(JOB.format(name="onhost", extra=""))
    (work / "box.yaml").write_text(JOB.format(name="inbox",
                                              extra=f"container: {container_section()}"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), ORCHESTRATE_RUNS=str(work / "runs"),
               OMP_NUM_THREADS="1")
    host = [sys.executable, "-m", "orchestrate", "submit", "host.yaml", "--follow"]
    box = [sys.executable, "-m", "orchestrate", "submit", "box.yaml", "--follow"]
    ratio = compare(("in a container (podman)", box), ("on the host", host), args.runs, work,
                    env)
    print(f"ratio container/host     {ratio:.3f}")

if __name__ == "__main__":
    main()
