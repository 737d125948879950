"""A stand-in ``nvidia-smi`` for tests that need GPUs on a machine without any: the GPUs and the
compute processes it lists are the test's (tests/probe/fake_nvidia_smi.py replays them)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

PROBE_TESTS = Path(__file__).resolve().parents[1] / "probe"


def fake_nvidia_smi(folder: Path, gpus: list[tuple[int, str, int]],
                    apps: list[tuple[int, str, int, int]] | None = None) -> Path:
    """A stand-in ``nvidia-smi`` (GPUs cannot exist here): tests/probe/fake_nvidia_smi.py
    replaying these GPUs (index, name, memory.total MiB) and compute processes (pid, process
    name, GPU index, used MiB), in nvidia-smi's own CSV format (that file says where the
    format comes from). Run by the system Python, so that every user can run it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "nvsmi"
    data.mkdir(exist_ok=True)
    rows = "".join(f"{i}, GPU-{i:08d}-0000-0000-0000-000000000000, 00000000:{16 + i:02X}:00.0, "
                   f"{name}, {mib}, 0\n" for i, name, mib in gpus)
    (data / "query.csv").write_text("index, uuid, pci.bus_id, name, memory.total [MiB], "
                                    "utilization.gpu [%]\n" + rows)
    set_compute_apps(folder, apps or [])
    script = folder / "nvidia-smi"
    script.write_text("#!/usr/bin/python3\nimport os\n"
                      f"os.environ.setdefault('FAKE_NVSMI_DIR', {str(data)!r})\n"
                      + (PROBE_TESTS / "fake_nvidia_smi.py").read_text())
    script.chmod(0o755)
    for path in (folder, data, *data.iterdir()):
        path.chmod(path.stat().st_mode | 0o055)
    return folder


def set_compute_apps(folder: Path, apps: list[tuple[int, str, int, int]]) -> None:
    """What the stand-in of :func:`fake_nvidia_smi` lists as compute processes from now on:
    ``(pid, process name, GPU index, used MiB)``."""
    rows = "".join(f"{pid}, {name}, GPU-{gpu:08d}-0000-0000-0000-000000000000, "
                   f"00000000:{16 + gpu:02X}:00.0, {mib}\n" for pid, name, gpu, mib in apps)
    path = folder / "nvsmi" / "apps.csv"
    path.write_text("pid, process_name, gpu_uuid, gpu_bus_id, used_gpu_memory [MiB]\n" + rows)
    path.chmod(0o644)


HEALTH_CASES = Path(__file__).resolve().parents[1] / "hostside" / "gpuhealth"
DMESG_DENIED = "dmesg: read kernel buffer failed: Operation not permitted\n"
JOURNAL_DENIED = ("No journal files were opened due to insufficient permissions.\n")


def replay_health(folder: Path, case: str, kernel: str | None = "") -> Path:
    """The stand-in ``nvidia-smi`` of :func:`fake_nvidia_smi` replaying the GPUs of a health
    case (tests/hostside/gpuhealth/CASE/query.csv, see SOURCE.md there), and stand-in ``dmesg``
    and ``journalctl`` printing the case's ``kernel.txt`` (``kernel`` None: both refused, as for
    a plain user under ``kernel.dmesg_restrict``; a string: that instead of the case's)."""
    fake_nvidia_smi(folder, [])
    (folder / "nvsmi" / "query.csv").write_text((HEALTH_CASES / case / "query.csv").read_text())
    text = kernel
    if text == "" and (HEALTH_CASES / case / "kernel.txt").exists():
        text = (HEALTH_CASES / case / "kernel.txt").read_text()
    fake_kernel_log(folder, text)
    return folder


def fake_kernel_log(folder: Path, text: str | None) -> None:
    """Stand-in ``dmesg`` and ``journalctl`` in ``folder``: printing ``text`` (``dmesg``; the
    journal would say the same), or, with None, refusing as they do for a plain user."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "kernel.log"
    log.write_text(text or "")
    for name, denied in (("dmesg", DMESG_DENIED), ("journalctl", JOURNAL_DENIED)):
        script = folder / name
        if text is None:
            script.write_text(f"#!/bin/sh\necho {shlex.quote(denied.strip())} >&2\nexit 1\n")
        else:
            script.write_text(f"#!/bin/sh\ncat {str(log)!r}\n")
        script.chmod(0o755)
    log.chmod(0o644)


def health_facts(case: str, kernel: str | None = "") -> dict[str, Any]:
    """What :func:`orchestrate.hostside.gpuhealth.gather` returns on a host replaying ``case``
    (see :func:`replay_health`), read from its files without running anything: for unit tests
    of the verdicts. The fields are those the gatherer asks."""
    from orchestrate.hostside.gpuhealth import HEALTH_FIELDS, XID_MARK
    from orchestrate.hostside.smicsv import rows

    found = rows((HEALTH_CASES / case / "query.csv").read_text())
    text = kernel
    if text == "" and (HEALTH_CASES / case / "kernel.txt").exists():
        text = (HEALTH_CASES / case / "kernel.txt").read_text()
    log = ({"readable": False, "source": None, "xid": [], "detail": "the kernel log is not "
            "readable here (dmesg: " + DMESG_DENIED.strip() + ")"} if text is None else
           {"readable": True, "source": "dmesg", "detail": None,
            "xid": [line.strip() for line in text.splitlines() if XID_MARK in line]})
    return {"status": "ok", "error": None, "fields": list(HEALTH_FIELDS), "dropped": [],
            "gpus": [{f: row.get(f, "[N/A]") for f in HEALTH_FIELDS} for row in found],
            "kernel_log": log}


def sick_on_one_node(folder: Path, case: str, mark: Path, claim: bool) -> Path:
    """Stand-in ``nvidia-smi``, ``dmesg`` and ``journalctl`` for the nodes of the Slurm test
    cluster (one machine: they share this file system, ``SLURMD_NODENAME`` tells them apart):
    on the node named in ``mark`` they replay health ``case``, elsewhere the healthy one; with
    ``claim``, the first node to run one of them writes its name there (so the node a job
    happens to land on is the sick one); without, whoever writes ``mark`` chooses."""
    sick = replay_health(folder / "sick", case)
    well = replay_health(folder / "healthy", "healthy")
    take = (f'(set -C; printf "%s\\n" "$SLURMD_NODENAME" >{shlex.quote(str(mark))}) '
            "2>/dev/null || true\n" if claim else "")
    for name in ("nvidia-smi", "dmesg", "journalctl"):
        script = folder / name
        script.write_text(
            "#!/bin/sh\n" + take
            + f'if [ "$(cat {shlex.quote(str(mark))} 2>/dev/null)" = "$SLURMD_NODENAME" ]; then\n'
            f'  exec {shlex.quote(str(sick / name))} "$@"\nfi\n'
            f'exec {shlex.quote(str(well / name))} "$@"\n')
        script.chmod(0o755)
    return folder
