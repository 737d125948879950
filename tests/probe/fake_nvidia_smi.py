"""A stand-in ``nvidia-smi`` that replays a captured machine (tests/probe/fixtures/<box>/).

Installed on PATH as ``nvidia-smi`` by the tests. It answers the two calls the gatherer makes,
from the files of the folder in ``FAKE_NVSMI_DIR``:

- ``--query-gpu=F1,F2,... --format=csv[,noheader][,nounits]``: the header and columns asked for,
  in that order, from ``query.csv``; ``[N/A]`` for a column the fixture lacks, the way
  nvidia-smi prints a field a GPU does not support. A field named in ``FAKE_NVSMI_UNKNOWN``
  (comma-separated) is refused with nvidia-smi's message for a field its driver does not know.
- ``--query-compute-apps=F1,F2,... --format=csv[,noheader][,nounits]``: the compute processes,
  from ``apps.csv`` (none without one: the header alone, as nvidia-smi prints for idle GPUs).
- ``memory.used`` in ``--query-gpu``: from ``query.csv`` if it has the column, else the sum of
  ``used_gpu_memory`` of ``apps.csv``'s processes on that GPU (matched by bus id).
- ``topo -m``: ``topo.txt``.

The CSV format is nvidia-smi's own (``nvidia-smi --help-query-gpu`` and
``--help-query-compute-apps`` of driver 535-560 list the fields; the header is each field's
name, with its unit in brackets, ``, ``-separated): e.g.
``nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid,gpu_bus_id,process_name --format=csv``
prints ``pid, used_gpu_memory [MiB], gpu_uuid, gpu_bus_id, process_name`` and then rows such as
``4242, 30720 MiB, GPU-5c1c...,00000000:25:00.0, python3``. ``used_memory`` is an alias of
``used_gpu_memory`` (the header says ``used_gpu_memory``). With ``nounits`` the ``MiB`` suffix
is left off the values (the fixtures store values without units, as ``nounits`` prints them).

With ``stdout.txt`` in the folder it prints that and exits with ``FAKE_NVSMI_EXIT`` (default 18)
whatever it was asked: a driver that fails. ``FAKE_NVSMI_SLEEP`` seconds are slept first.
"""

import os
import sys
import time


def main(argv):
    folder = os.environ["FAKE_NVSMI_DIR"]
    time.sleep(float(os.environ.get("FAKE_NVSMI_SLEEP") or 0))
    failing = os.path.join(folder, "stdout.txt")
    if os.path.exists(failing):
        with open(failing) as handle:
            sys.stdout.write(handle.read())
        return int(os.environ.get("FAKE_NVSMI_EXIT") or 18)
    if argv[:2] == ["topo", "-m"]:
        with open(os.path.join(folder, "topo.txt")) as handle:
            sys.stdout.write(handle.read())
        return 0
    form = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    apps = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-compute-apps=")),
                None)
    if apps is not None and form.startswith("csv"):
        return _apps(folder, apps.split(","), form)
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is None or not form.startswith("csv"):
        sys.stdout.write("stand-in nvidia-smi: only --query-gpu=... --format=csv, "
                         "--query-compute-apps=... --format=csv and topo -m\n")
        return 2
    fields = query.split(",")
    unknown = [f for f in (os.environ.get("FAKE_NVSMI_UNKNOWN") or "").split(",") if f]
    for field in fields:
        if field in unknown:
            sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
            return 2
    with open(os.path.join(folder, "query.csv")) as handle:
        lines = [line.rstrip("\n") for line in handle if line.strip()]
    header = [c.strip() for c in lines[0].split(",")]
    names = [h.split(" [")[0] for h in header]
    used = _used_by_bus(folder)
    if "memory.used" not in names:
        header.append("memory.used [MiB]")
        names.append("memory.used")
        bus = names.index("pci.bus_id") if "pci.bus_id" in names else None
        lines = [lines[0]] + [
            line + ", " + str(used.get(_cells(line)[bus].lower(), 0) if bus is not None else 0)
            for line in lines[1:]]
    out = []
    if "noheader" not in form:
        out.append(", ".join(header[names.index(f)] if f in names else f for f in fields))
    for line in lines[1:]:
        cells = _cells(line)
        out.append(", ".join(_unit(cells[names.index(f)], header[names.index(f)], form)
                             if f in names else "[N/A]" for f in fields))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _cells(line):
    return [c.strip() for c in line.split(",")]


def _unit(value, head, form):
    """A value as nvidia-smi prints it: with its unit unless ``nounits``."""
    if "nounits" in form or "[" not in head or value.startswith("["):
        return value
    return value + " " + head.split("[", 1)[1].rstrip("]")


def _app_rows(folder):
    path = os.path.join(folder, "apps.csv")
    if not os.path.exists(path):
        return ["pid, process_name, gpu_uuid, gpu_bus_id, used_gpu_memory [MiB]"]
    with open(path) as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


def _used_by_bus(folder):
    lines = _app_rows(folder)
    names = [h.split(" [")[0] for h in _cells(lines[0])]
    used = {}
    for line in lines[1:]:
        cells = _cells(line)
        bus = cells[names.index("gpu_bus_id")].lower()
        used[bus] = used.get(bus, 0) + int(cells[names.index("used_gpu_memory")])
    return used


def _apps(folder, fields, form):
    """``--query-compute-apps``: the processes of ``apps.csv``, the fields asked for."""
    lines = _app_rows(folder)
    header = _cells(lines[0])
    names = [h.split(" [")[0] for h in header]
    fields = ["used_gpu_memory" if f == "used_memory" else f for f in fields]
    for field in fields:
        if field not in names and field not in ("gpu_name", "gpu_serial"):
            sys.stdout.write(f'Field "{field}" is not a valid field to query.\n\n')
            return 2
    out = []
    if "noheader" not in form:
        out.append(", ".join(header[names.index(f)] if f in names else f for f in fields))
    for line in lines[1:]:
        cells = _cells(line)
        out.append(", ".join(_unit(cells[names.index(f)], header[names.index(f)], form)
                             if f in names else "[N/A]" for f in fields))
    sys.stdout.write("".join(row + "\n" for row in out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
