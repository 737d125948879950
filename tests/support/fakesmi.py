"""A stand-in ``nvidia-smi`` for tests that need GPUs on a machine without any: the GPUs and the
compute processes it lists are the test's (tests/probe/fake_nvidia_smi.py replays them)."""

from __future__ import annotations

from pathlib import Path

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
