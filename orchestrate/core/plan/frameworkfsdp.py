"""Framework-level FSDP asked for in a ``command:`` job's program or config text, found at plan
time, and what the plan says of it. Pure: texts in, sentences out (the files are read by
:mod:`orchestrate.run.programtext`; nothing is imported).

Lightning (``strategy="fsdp"``, ``FSDPStrategy``), accelerate (``FullyShardedDataParallelPlugin``,
``fsdp_plugin=``, ``distributed_type: FSDP`` in its config, ``ACCELERATE_USE_FSDP``) and the
Hugging Face Trainer (``fsdp="full_shard ..."``, ``--fsdp``, ``"fsdp": "..."`` in a JSON config)
shard the model themselves, on CUDA GPUs only (docs/frameworks.md): on a CPU-only job Lightning
refuses at start, while accelerate and the Trainer run DDP without a word, every rank holding
the whole model. orchestrate cannot see what the program will do, but it can read what it
says: such a sign on a plan without GPUs is a warning, and on one with GPUs a note that the
sharding (and its memory) is the framework's, not the plan's estimate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: (pattern, what it is) in the order tried; matched per line, comments (#, //) left out.
_SIGNS = (
    (re.compile(r"""strategy\s*=\s*["']fsdp"""), 'Lightning strategy="fsdp"'),
    (re.compile(r"\bFSDPStrategy\s*\("), "Lightning FSDPStrategy"),
    (re.compile(r"\bFullyShardedDataParallelPlugin\s*\("), "accelerate's FSDP plugin"),
    (re.compile(r"\bfsdp_plugin\s*=\s*(?!None\b)"), "accelerate's fsdp_plugin="),
    (re.compile(r"^\s*distributed_type\s*:\s*['\"]?FSDP\b"),
     "accelerate's config distributed_type: FSDP"),
    (re.compile(r"""\bfsdp\s*=\s*["'][^"']*(full_shard|shard_grad_op|hybrid_shard|offload)"""),
     "the HF Trainer's fsdp="),
    (re.compile(r""""fsdp"\s*:\s*"[^"]*(full_shard|shard_grad_op|hybrid_shard|offload)"""),
     'the HF Trainer\'s "fsdp" argument'),
    (re.compile(r"(?:^|\s)--fsdp[\s=]+['\"]?(full_shard|shard_grad_op|hybrid_shard|offload)"),
     "the HF Trainer's --fsdp"),
)
_COMMENT = re.compile(r"^\s*(#|//)")
_TRUE = ("1", "true", "yes")


@dataclass(frozen=True)
class Sign:
    """Where framework-level FSDP is asked for (``train.py:12``, ``env: ACCELERATE_USE_FSDP``)
    and how."""

    where: str
    what: str

    def shown(self) -> str:
        return f"{self.where}: {self.what}"


def signs_in(name: str, text: str, limit: int = 3) -> list[Sign]:
    """The FSDP signs in one file's text, at most ``limit``, named ``name:LINE``."""
    found: list[Sign] = []
    for number, line in enumerate(text.splitlines(), 1):
        if _COMMENT.match(line):
            continue
        for pattern, what in _SIGNS:
            if pattern.search(line):
                found.append(Sign(f"{name}:{number}", what))
                break
        if len(found) >= limit:
            break
    return found


def signs_in_env(env: Mapping[str, object]) -> list[Sign]:
    """``ACCELERATE_USE_FSDP`` set true in the job's ``env:``."""
    value = str(env.get("ACCELERATE_USE_FSDP", "")).strip().lower()
    return [Sign("env", "ACCELERATE_USE_FSDP=true")] if value in _TRUE else []


def advice(signs: list[str], any_gpu: bool) -> tuple[list[str], list[str]]:
    """(warnings, notes) for the plan, from the signs found (each ``where: what``)."""
    if not signs:
        return [], []
    shown = "; ".join(signs[:3]) + (f" (and {len(signs) - 3} more)" if len(signs) > 3 else "")
    if not any_gpu:
        return [f"framework-level FSDP asked for ({shown}) on a job without GPUs: Lightning "
                "refuses at start, accelerate and the HF Trainer run DDP with every rank "
                "holding the whole model (docs/frameworks.md: give the job GPUs, or use "
                "train: {strategy: fsdp}, which shards on CPUs too)"], []
    return [], [f"framework-level FSDP asked for ({shown}): the framework shards the model "
                "on the GPUs, not orchestrate; the plan's memory figures do not count its "
                "sharding; check accelerator.distributed_type on rank 0 at the first run "
                "(docs/frameworks.md)"]
