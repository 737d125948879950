"""``python -m orchestrate.train --config CONFIG.json [--run-dir DIR]``: one rank of a job.

The launcher starts this on every rank with the torchrun environment (or under ``srun``), in the
job's workdir, with ``CONFIG.json`` = ``TrainSpec.model_dump(mode="json")``. Everything that can
be wrong before training (the config, the environment) is checked here, before ``import torch``
(seconds per rank), and reported as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrate.core.errors import EXIT_USER_ERROR, UserError
from orchestrate.core.spec.loader import validate
from orchestrate.core.spec.trainspec import TrainSpec, combination_problems
from orchestrate.train.env import parse_dist_env


def load_spec(path: Path) -> TrainSpec:
    """The config file the launcher wrote, validated."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError.single(f"cannot read: {exc.strerror}", source=str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError.single(
            f"not valid JSON: {exc.msg} (line {exc.lineno})", source=str(path)
        ) from None
    spec = validate(TrainSpec, data, str(path))
    problems = combination_problems(spec, str(path), prefix="", as_written=False)
    if problems:
        raise UserError(problems)
    return spec


def resolve_run_dir(given: Path | None, environ: Mapping[str, str]) -> Path:
    """``--run-dir``, else ``ORCHESTRATE_RUN_DIR``, else the working directory."""
    if given is not None:
        return given.expanduser().absolute()
    from_env = environ.get("ORCHESTRATE_RUN_DIR", "").strip()
    return Path(from_env).expanduser().absolute() if from_env else Path.cwd()


def put_workdir_on_path() -> None:
    """Make ``module:function`` paths resolve against the job's workdir (the cwd), as
    ``python -m`` does, whoever started us."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank; returns its exit status (0, 1, 2 or 75: see docs/train.md)."""
    parser = argparse.ArgumentParser(
        prog="python -m orchestrate.train",
        description="One rank of a DDP training job (see docs/train.md).",
    )
    parser.add_argument("--config", required=True, type=Path, help="TrainSpec as JSON")
    parser.add_argument("--run-dir", type=Path, help="metrics and checkpoints go here")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.config)
        env = parse_dist_env(os.environ)
    except UserError as err:
        print(f"orchestrate.train: {err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    run_dir = resolve_run_dir(args.run_dir, os.environ)
    put_workdir_on_path()
    from orchestrate.train.session import run_session  # imports torch: seconds

    return run_session(spec, env, run_dir, os.environ)
