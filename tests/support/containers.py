"""The container tests' image, built here (no registry is reachable from the test machines).

``localhost/orchestrate-test:1`` is an almost empty root filesystem (the merged-/usr links, a
passwd file), made with ``podman import`` of a tarball built in Python (0.3 s, cached in
podman's store between runs). Jobs that use it mount this machine's ``/usr`` and the pyenv
Python (with torch CPU) read-only: the image stays tiny and the interpreter inside is the one
the tests run with. The flags this VM needs (docs/containers.md): its root lacks
CAP_SYS_RESOURCE, so podman's default rlimits cannot be set and lowered ones are passed.
"""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

IMAGE = "localhost/orchestrate-test:1"
#: The interpreter the tests run, as the container sees it (mounted at the same path).
PYTHON = str(Path(sys.executable).resolve())
#: Where that interpreter lives (pyenv's versions folder), mounted read-only.
PYTHON_ROOT = str(Path(PYTHON).parents[2])
#: The rlimits this VM lets a runtime set (podman's defaults fail: no CAP_SYS_RESOURCE).
VM_OPTIONS = ("--ulimit=nofile=4096:4096", "--ulimit=nproc=4096:4096")


def _rootfs_tar() -> bytes:
    """The image's root filesystem: empty folders, /bin -> usr/bin style links, passwd."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for folder in ("usr", "root", "tmp", "proc", "sys", "dev", "etc", "run", "srv"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
            tar.addfile(info)
        for link in ("bin", "lib", "lib64", "sbin"):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{link}"
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@functools.cache
def built_image() -> str:
    """The test image's name, imported into podman's store unless it is there already."""
    if shutil.which("podman") is None:
        raise AssertionError("podman is not installed: tests/setup.sh installs it")
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode != 0:
        subprocess.run(["podman", "import", "-", IMAGE], input=_rootfs_tar(), check=True,
                       capture_output=True, timeout=120)
    return IMAGE


def container_section(*, ipc: str = "host", extra_mounts: tuple[str, ...] = (),
                      env: tuple[str, ...] = (), image: str | None = None) -> str:
    """A job's ``container:`` section (YAML flow style) running the test image."""
    mounts = ["/usr:/usr:ro", f"{PYTHON_ROOT}:{PYTHON_ROOT}:ro", *extra_mounts]
    return ("{" + f"image: {image or built_image()}, runtime: podman, python: {PYTHON}, "
            f"pull: never, ipc: {ipc}, mounts: [{', '.join(mounts)}], "
            f"env: [{', '.join(env)}], options: [{', '.join(VM_OPTIONS)}]" + "}")


def containers_of(job_id: str) -> list[str]:
    """The names of the podman containers labelled with the job (running or not)."""
    out = subprocess.run(["podman", "ps", "--all", "--filter", f"label=orchestrate.job={job_id}",
                          "--format", "{{.Names}}"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return out.split()
