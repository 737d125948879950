"""What the GPU health check adds to ``orchestrate submit --preflight`` on one host (issue #35).

``submit --preflight`` runs the check twice: in the doctor's ``health`` tier (each node's
leader, beside the static facts) and before the supervisor leases the GPUs. Both are measured
with the check on and off, side by side, on the same 1-GPU job (gloo, command ``true``):

- ``submit --follow`` with ``ORCHESTRATE_GPU_HEALTH`` unset and ``=off`` (the check before the
  lease);
- ``doctor --tier health`` against ``doctor --tier static`` (the tier; ``health`` includes
  ``static``). The doctor's exit status is not asked: on a machine whose torch is a CPU build
  the static tier fails the GPU row (which also stops a whole ``submit --preflight`` there:
  hence the two parts), and the timing is the same.

Interleaved (on, off, on, ...) so machine noise hits both alike; medians (min, max), and the
sum of the two differences against the target (at most 0.3 s). Then the gathering alone (one
``nvidia-smi`` health query and the kernel log), median of ``--gathers`` calls in this process.

Without GPUs here it runs on the lab server replayed by the stand-in ``nvidia-smi``,
``dmesg`` and ``journalctl`` (tests/hostside/gpuhealth/healthy): each stand-in call starts a
Python interpreter (~30-60 ms), about what a real ``nvidia-smi`` query takes on an 8-GPU box.
With ``--real`` it uses this machine's own nvidia-smi, and the job takes any one of its GPUs
(a machine with one GPU will do).

    python bench/gpu_health.py [--runs 5] [--gathers 10] [--real]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrate.hostside import gpuhealth  # noqa: E402
from tests.support.fakesmi import replay_health  # noqa: E402

#: One GPU: the stand-in's lab server is asked for an A100 (its first model); a machine's own
#: GPUs (``--real``, one GPU or more, any model) for any one of them.
JOB = """
name: health
resources: {{nodes: 1, gpus_per_node: 1{model}}}
distributed: {{backend: gloo}}
command: ["true"]
"""


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    if proc.returncode != 0 and argv[3] != "doctor":
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gathers", type=int, default=10)
    parser.add_argument("--real", action="store_true", help="this machine's own nvidia-smi")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-health-"))
    (work / "job.yaml").write_text(JOB.format(model="" if args.real else
                                              ", gpu_model: A100-80GB"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"), ORCHESTRATE_LEASES=str(work / "book"),
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if not args.real:
        bin_dir = replay_health(work / "bin", "healthy")
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
        os.environ["PATH"] = env["PATH"]
    off = {**env, "ORCHESTRATE_GPU_HEALTH": "off"}
    pairs = [("submit --follow", ("check on", env, "submit"), ("check off", off, "submit")),
             ("doctor", ("--tier health", env, "health"), ("--tier static", env, "static"))]
    print(f"1 GPU, {args.runs} runs each (interleaved), load average "
          f"{os.getloadavg()[0]:.1f}, {'real' if args.real else 'stand-in'} nvidia-smi")
    added = 0.0
    for title, *sides in pairs:
        times: dict[str, list[float]] = {label: [] for label, _, _ in sides}
        for run in range(-1, args.runs):  # run -1 warms the page cache
            for label, side, how in sides:
                took = timed(_command(how, run), work, side)
                if run >= 0:
                    times[label].append(took)
        for label, runs in times.items():
            print(f"  {title} {label:<14} median {statistics.median(runs):.3f} s  "
                  f"(min {min(runs):.3f}, max {max(runs):.3f})")
        on, off_times = times.values()
        added += statistics.median(on) - statistics.median(off_times)
    print(f"  added by the check to submit --preflight: {added:+.3f} s (target <= 0.3 s)")
    gathers = []
    for _ in range(args.gathers):
        started = time.monotonic()
        found = gpuhealth.gather()
        gathers.append(time.monotonic() - started)
    print(f"gather() alone: median {statistics.median(gathers) * 1000:.0f} ms "
          f"(min {min(gathers) * 1000:.0f}, max {max(gathers) * 1000:.0f}; status "
          f"{found['status']}, kernel log readable: {found['kernel_log']['readable']})")


def _command(how: str, run: int) -> list[str]:
    if how == "submit":
        job_id = f"health-{run + 1}-{time.time_ns()}"
        return [sys.executable, "-m", "orchestrate", "submit", "job.yaml", "--follow",
                "--job-id", job_id]
    return [sys.executable, "-m", "orchestrate", "doctor", "job.yaml", "--tier", how, "--json"]


if __name__ == "__main__":
    main()
