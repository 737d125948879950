"""Helpers for the probe tests: a stand-in nvidia-smi on PATH, fake sysfs trees, the CLI.

The gatherer (orchestrate.hostside.hostfacts) runs for real: it executes the stand-in ``nvidia-smi``
(tests/probe/fake_nvidia_smi.py, replaying the captured outputs in tests/probe/fixtures/) and
reads the fake sysfs tree through ``ORCHESTRATE_SYSFS_ROOT``; only the hardware is stood in.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.cli import main

REPO = Path(__file__).resolve().parents[2]
PROBE_TESTS = REPO / "tests" / "probe"
FIXTURES = PROBE_TESTS / "fixtures"
GOLDEN = PROBE_TESTS / "golden"
UPDATE_GOLDEN = os.environ.get("ORCHESTRATE_UPDATE_GOLDEN") == "1"


@dataclass(frozen=True)
class Result:
    """What a person sees: the exit status, standard output and standard error."""

    code: int
    out: str
    err: str


def cli(*args: str | Path) -> Result:
    """Run ``orchestrate ARGS`` in this process, as the console script does."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return Result(code, out.getvalue(), err.getvalue())


def install_nvidia_smi(bin_dir: Path) -> Path:
    """Put the stand-in ``nvidia-smi`` into ``bin_dir`` (run by this interpreter)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n" + (PROBE_TESTS / "fake_nvidia_smi.py").read_text(), encoding="utf-8"
    )
    script.chmod(0o755)
    return script


# ------------------------------------------------------------------------------ fake sysfs


@dataclass(frozen=True)
class Nic:
    """One /sys/class/net entry. ``physical``: has a ``device`` link (a PCI function)."""

    name: str
    speed: int | None = None  # Mb/s as sysfs writes it; None: reading fails (link down)
    operstate: str = "up"
    kind: str = "physical"  # physical | ipoib | bridge | virtual | loopback
    mtu: int = 1500


@dataclass(frozen=True)
class Hca:
    """One /sys/class/infiniband entry with one port, in the kernel's formats."""

    name: str
    netdev: str | None
    state: str = "4: ACTIVE"
    rate: str = "400 Gb/sec (4X NDR)"
    link_layer: str = "InfiniBand"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


def make_sysfs(root: Path, nics: list[Nic], hcas: list[Hca] | None = None) -> Path:
    """A sysfs tree with these interfaces and HCAs, laid out as the kernel does."""
    for nic in nics:
        base = root / "class" / "net" / nic.name
        base.mkdir(parents=True, exist_ok=True)
        write(base / "operstate", nic.operstate)
        write(base / "mtu", str(nic.mtu))
        write(base / "type", {"ipoib": "32", "loopback": "772"}.get(nic.kind, "1"))
        if nic.speed is not None:
            write(base / "speed", str(nic.speed))
        if nic.kind in ("physical", "ipoib"):
            device = root / "devices" / "pci0000:00" / f"0000:00:{len(nic.name):02x}.0"
            device.mkdir(parents=True, exist_ok=True)
            (base / "device").symlink_to(device)
        if nic.kind == "bridge":
            (base / "bridge").mkdir()
    for hca in hcas or []:
        base = root / "class" / "infiniband" / hca.name
        port = base / "ports" / "1"
        write(port / "state", hca.state)
        write(port / "rate", hca.rate)
        write(port / "link_layer", hca.link_layer)
        (base / "device" / "net").mkdir(parents=True, exist_ok=True)
        if hca.netdev:
            (base / "device" / "net" / hca.netdev).mkdir()
    return root


#: Never to be chosen: a docker bridge, a container's veth, the loopback.
VIRTUAL = [Nic("docker0", speed=None, kind="bridge"), Nic("veth3f2a1c9", speed=10000,
           kind="virtual"), Nic("lo", speed=None, operstate="unknown", kind="loopback")]

#: The sysfs of each captured machine: the README's lab runs 10 Gb/s ethernet; the H100 box
#: has NDR InfiniBand (and a 1 Gb/s management port); the A100 box 100 Gb/s RoCE.
SYSFS: dict[str, tuple[list[Nic], list[Hca]]] = {
    "ambers-a100-a6000": ([Nic("eno1", 10000), Nic("eno2", None, operstate="down"), *VIRTUAL],
                          []),
    "h100-nvswitch": ([Nic("eno1", 1000), Nic("ib0", None, kind="ipoib", mtu=4092), *VIRTUAL],
                      [Hca("mlx5_0", "ib0"), Hca("mlx5_1", None, state="1: DOWN",
                                                 rate="10 Gb/sec (4X SDR)")]),
    "a100-nvlink-pairs": ([Nic("ens1f0np0", 100000), Nic("eno1", 1000), *VIRTUAL],
                          [Hca("mlx5_0", "ens1f0np0", rate="100 Gb/sec (4X EDR)",
                               link_layer="Ethernet")]),
    "cpu": ([Nic("eth0", 25000), *VIRTUAL], []),
}


@contextlib.contextmanager
def machine(tmp: Path, box: str | None, **env: str) -> Iterator[Path]:
    """This process (and its children) see ``box``: its nvidia-smi outputs on PATH (none for a
    CPU machine: ``box`` None or ``"cpu"``) and its sysfs tree. Yields the sysfs root."""
    saved = {k: os.environ.get(k) for k in ("PATH", "ORCHESTRATE_SYSFS_ROOT", "FAKE_NVSMI_DIR",
                                             "ORCHESTRATE_RUNTIMES_PATH", *env)}
    bin_dir = tmp / f"bin-{box}"
    nics, hcas = SYSFS.get(box or "cpu", SYSFS["cpu"])
    root = tmp / f"sys-{box}"
    if not root.exists():
        make_sysfs(root, nics, hcas)
    # The real PATH, less any real nvidia-smi: the machine is the fixture's, not this one's.
    path = os.pathsep.join(p for p in (saved["PATH"] or "").split(os.pathsep)
                           if p and not os.path.exists(os.path.join(p, "nvidia-smi")))
    if box and box != "cpu":
        install_nvidia_smi(bin_dir)
        os.environ["FAKE_NVSMI_DIR"] = str(FIXTURES / box)
        path = f"{bin_dir}:{path}"
    os.environ["PATH"] = path
    os.environ["ORCHESTRATE_SYSFS_ROOT"] = str(root)
    # Container runtimes are looked up in the machine's own bin folder (podman, docker: none
    # unless a test puts a stand-in there), not on this one's PATH.
    bin_dir.mkdir(parents=True, exist_ok=True)
    os.environ["ORCHESTRATE_RUNTIMES_PATH"] = str(bin_dir)
    os.environ.update(env)
    try:
        yield root
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def normalise(text: str) -> str:
    """Output with this run's date and this machine's CPU count made stable for goldens."""
    text = re.sub(r"probed \d{4}-\d\d-\d\d \d\d:\d\d UTC", "probed <DATE>", text)
    cpus = len(os.sched_getaffinity(0))
    return re.sub(rf"^(\s+)cpus: {cpus}$", r"\1cpus: <CPUS>", text, flags=re.MULTILINE)


def check_golden(name: str, text: str) -> None:
    """``text`` equals the golden file (ORCHESTRATE_UPDATE_GOLDEN=1 rewrites it)."""
    path = GOLDEN / name
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{name}", "written"))
        raise AssertionError(f"the written inventory differs from golden/{name}:\n{diff}")


def facts_of(raw: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of raw facts with top-level keys replaced."""
    return {**raw, **changes}
