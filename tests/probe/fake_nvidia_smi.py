"""A stand-in ``nvidia-smi`` that replays a captured machine (tests/probe/fixtures/<box>/).

Installed on PATH as ``nvidia-smi`` by the tests. It answers the two calls the gatherer makes,
from the files of the folder in ``FAKE_NVSMI_DIR``:

- ``--query-gpu=F1,F2,... --format=csv[,noheader][,nounits]``: the header and columns asked for,
  in that order, from ``query.csv``; ``[N/A]`` for a column the fixture lacks, the way
  nvidia-smi prints a field a GPU does not support. A field named in ``FAKE_NVSMI_UNKNOWN``
  (comma-separated) is refused with nvidia-smi's message for a field its driver does not know.
- ``topo -m``: ``topo.txt``.

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
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    form = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    if query is None or not form.startswith("csv"):
        sys.stdout.write("stand-in nvidia-smi: only --query-gpu=... --format=csv and topo -m\n")
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
    out = []
    if "noheader" not in form:
        out.append(", ".join(header[names.index(f)] if f in names else f for f in fields))
    for line in lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        out.append(", ".join(cells[names.index(f)] if f in names else "[N/A]" for f in fields))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
