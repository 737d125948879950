"""Slurm 24.11 for real: Debian 13's release in its own root (tests/clusters/slurm-root.sh), a
one-node cluster brought up, used and torn down by the test, its outputs read by the backend's
parsers. Skipped, with the reason, until ``slurm-root.sh root`` has built the root (minutes and
~47 MB of packages; tests/setup.sh starts it in the background: docs/testing-clusters.md,
"Second release"). The core Slurm tests run on the 3-node 24.11 cluster too (``@BOTH_RELEASES``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from orchestrate.backends.slurm.ctl import job_state_name, parse_show_job, parse_show_node
from orchestrate.backends.slurm.version import (
    SlurmVersion,
    parse_version,
    requeue_options,
)

pytestmark = [pytest.mark.process, pytest.mark.slurm_release]

SCRIPT = Path(__file__).resolve().parents[2] / "clusters" / "slurm-root.sh"
ROOT = Path(os.environ.get("ORCHESTRATE_SLURM_ROOT", "/var/cache/orchestrate/slurm-trixie"))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (ROOT / ".orchestrate-slurm-root").exists():
        pytest.skip(f"no Slurm 24.11 root at {ROOT}: tests/clusters/slurm-root.sh root")
    out = tmp_path_factory.mktemp("slurm2411")
    proc = subprocess.run([str(SCRIPT), "smoke", str(out)], capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_slurm_24_11_jobs_read_as_slurm_says(outputs: Path) -> None:
    version = parse_version((outputs / "version.txt").read_text())
    assert version is not None and SlurmVersion(24, 11) <= version < SlurmVersion(25, 5)
    assert requeue_options(version, requeue=True) == ()  # no --requeue=expedite before 25.11
    states = {}
    for name in ("ok", "failing", "held"):
        for form in ("", "-oneliner"):
            (job,) = parse_show_job((outputs / f"job-{name}{form}.txt").read_text())
            states[name + form] = (job_state_name(job), job["ExitCode"], job["JobName"])
    assert states["ok"] == states["ok-oneliner"] == ("COMPLETED", "0:0", "wrap")
    assert states["failing"] == states["failing-oneliner"] == ("FAILED", "3:0", "wrap")
    assert states["held"] == states["held-oneliner"] == (
        "PENDING", "0:0", "evil JobState=COMPLETED x")
    (node,) = parse_show_node((outputs / "node.txt").read_text())
    assert (node["NodeName"], node["Version"]) == ("n1", str(version))
