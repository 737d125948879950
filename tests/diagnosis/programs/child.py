"""A rank that starts a multiprocessing *spawn* child (as DataLoader workers with spawn do): the
child re-imports sitecustomize and must not start a second sidecar. Prints what each saw."""

import json
import multiprocessing
import os
import sys


def report(queue):
    car = getattr(sys, "_orchestrate_sidecar", None)
    queue.put({"pid": os.getpid(), "sidecar": car is not None,
               "owner": os.environ.get("ORCHESTRATE_SIDECAR_PID")})


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=report, args=(queue,))
    child.start()
    seen = queue.get(timeout=60)
    child.join(60)
    car = getattr(sys, "_orchestrate_sidecar", None)
    print(json.dumps({"parent": {"pid": os.getpid(), "sidecar": car is not None,
                                 "owner": os.environ.get("ORCHESTRATE_SIDECAR_PID")},
                      "child": seen,
                      "chained": os.environ.get("CHAINED_SITECUSTOMIZE")}), flush=True)
