"""How many times one `orchestrate submit` reads the job file, counted in every process.

A job is planned once, on the controller, from one read of its file: the detached supervisor,
a restart and a re-plan (an SSH host excluded, the master's interface found) start from the
run directory's ``loaded.json``, never from the job file again, so an edit of the file while
the job runs cannot change it halfway (issue 9: "re-plans per SSH submit: 1 read").

Every Python process that the submit starts (the CLI, the detached supervisor, what they
start) gets an audit hook, through a ``sitecustomize`` on PYTHONPATH, that appends one line to
a log for each ``open`` of the job file; the count is taken after the job ended. The job is
run with a restart (one rank fails on the first attempt), so re-planning is exercised too.

    python bench/job_file_reads.py [--backend local|ssh]

``ssh`` needs the test hosts (tests/clusters/sshhosts.sh; brought up here if none run; root
only) and must run under ``flock /tmp/orchestrate-cluster-tests.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from restart_time import SETUPS  # noqa: E402  (the backends' set-up: hosts, inventories)

AUDIT = """\
import os, sys

_WATCHED = os.environ.get("BENCH_WATCH_FILE")
_LOG = os.environ.get("BENCH_READ_LOG")


def _hook(event, args):
    if event == "open" and _WATCHED and args and isinstance(args[0], (str, bytes, os.PathLike)):
        try:
            if os.path.realpath(os.fsdecode(args[0])) == _WATCHED:
                with open(_LOG, "a") as log:  # not the watched file: no recursion
                    log.write(f"{os.getpid()} {' '.join(sys.argv[:3])[:120]}\\n")
        except Exception:
            pass


if _WATCHED and _LOG:
    sys.addaudithook(_hook)
"""

#: Fails on its first attempt (rank 1), succeeds on the second: one restart, one re-plan.
PROGRAM = """\
import os, sys
attempt = int(os.environ.get("ORCHESTRATE_ATTEMPT", "1"))
sys.exit(3 if attempt == 1 and os.environ["RANK"] == "1" else 0)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("local", "ssh"), default="local")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-reads-"))
    (work / "audit").mkdir()
    (work / "audit" / "sitecustomize.py").write_text(AUDIT)
    (work / "prog.py").write_text(PROGRAM)
    where = SETUPS[args.backend](work)[0] + "\n"
    job = work / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        name: reads
        backend: {args.backend}
        {where.rstrip().replace(chr(10), chr(10) + '        ')}
        distributed: {{backend: gloo}}
        restart: {{max: 1, on: [failure], backoff_s: [0]}}
        command: [{sys.executable}, {work / 'prog.py'}]
        """))
    log = work / "reads.log"
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), ORCHESTRATE_RUNS=str(work / "runs"),
               BENCH_WATCH_FILE=os.path.realpath(job), BENCH_READ_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(work / "audit"), str(ROOT)]))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "orchestrate", "submit", str(job), "--follow",
                           "--job-id", "reads-1"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    took = time.monotonic() - started
    status = subprocess.run([sys.executable, "-m", "orchestrate", "status", "reads-1", "--json"],
                            cwd=work, env=env, capture_output=True, text=True, timeout=60)
    record = json.loads(status.stdout)
    reads = log.read_text().splitlines() if log.exists() else []
    print(f"backend {args.backend}: submit --follow exit {proc.returncode} in {took:.1f} s, "
          f"state {record.get('state')}, attempts {len(record.get('attempts') or [])}")
    print(f"job file reads: {len(reads)}")
    for line in reads:
        print("  " + line)
    if proc.returncode != 0 or len(record.get("attempts") or []) != 2:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
