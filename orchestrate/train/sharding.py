"""``strategy: fsdp``: the model sharded with FSDP2, and what the two strategies share.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a ``DTensor`` sharded over
the ranks; each *unit* (``train.fsdp.wrap``: named module classes, or under ``auto`` the
repeated child blocks, see :func:`find_units`) gathers its parameters for its forward and
backward and frees them after, and gradients are reduce-scattered, so a rank holds 1/W of the
weights, gradients and optimizer state plus the units in flight.

The model is built the way large models must be: every rank builds it on the meta device (shapes,
no storage), shards it and allocates only its shards; rank 0 alone also builds it for real
(seeded as under DDP, so both strategies start from the same weights) and broadcasts it, tensor
by tensor. No other rank ever holds the full model. A factory that cannot run on the meta device
is built for real on every rank and sharded in place instead (said once).

Activation checkpointing (``train.activation_checkpointing``) recomputes a module's activations
in backward: the module's ``forward`` is replaced by one that calls the original under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (torch 2.13 only warns without
``use_reentrant``, then falls back to the reentrant variant). Replacing ``forward`` keeps the
module, its name and its state-dict keys (no ``_checkpoint_wrapped_module.`` prefix), and FSDP's
hooks stay around the call, as with ``checkpoint_wrapper`` applied before ``fully_shard``.

The model probe (:mod:`orchestrate.train.modelprobe`) shards and checkpoints the same way on fake
tensors, so the planner's traced estimate is of this layout.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train.failure import TrainFailure

#: Containers are looked through when blocks are searched: their children are the blocks.
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_BATCHNORM = (nn.modules.batchnorm._BatchNorm,)


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _level(module: nn.Module) -> list[nn.Module]:
    """The children of ``module``, with containers replaced by their own children."""
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_level(child) if isinstance(child, _CONTAINERS) else [child])
    return out


def class_names(module: nn.Module) -> list[str]:
    """The classes of the model's modules that hold parameters, in order of first appearance
    (what ``fsdp.wrap`` and ``activation_checkpointing`` may name)."""
    seen: dict[str, None] = {}
    for sub in module.modules():
        if sub is not module and not isinstance(sub, _CONTAINERS) and _owns_parameters(sub):
            seen.setdefault(type(sub).__name__, None)
    return list(seen)


def _auto_units(module: nn.Module) -> list[nn.Module]:
    """The repeated child blocks: level by level from the root (containers looked through), the
    first level where a class with parameters occurs at least twice; of those classes, the one
    whose instances hold the most parameters. None repeats: no units below the root."""
    level = _level(module)
    while level:
        counts = Counter(type(m) for m in level if _owns_parameters(m))
        repeated = [cls for cls, n in counts.items() if n >= 2]
        if repeated:
            held = {cls: sum(p.numel() for m in level if type(m) is cls for p in m.parameters())
                    for cls in repeated}
            best = max(repeated, key=held.__getitem__)
            return [m for m in level if type(m) is best]
        level = [grand for m in level for grand in _level(m)]
    return []


def find_units(module: nn.Module, wrap: str | Sequence[str], field: str = "fsdp.wrap"
               ) -> list[nn.Module]:
    """The modules that become FSDP units: every instance of the named classes (outermost
    first; a named module inside another named one is its own unit too), or the repeated
    blocks under ``auto``. Names the model does not have are a :class:`UserError` that lists
    the classes it has."""
    if wrap == "auto":
        return _auto_units(module)
    names = list(wrap)
    present = class_names(module)
    missing = [n for n in names if n not in present]
    if missing:
        raise UserError(Problem(
            f"the model has no module class {', '.join(missing)}", source="train",
            field=field, got=", ".join(missing),
            hint="classes with parameters in this model: " + (", ".join(present[:20]) or "none")
            + ("" if field != "fsdp.wrap" else "; or write auto")))
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


def checkpointed(module: nn.Module, spec: TrainSpec, units: list[nn.Module]) -> list[nn.Module]:
    """The modules whose activations are recomputed: none, the units (true; under DDP the
    blocks ``auto`` finds), or every instance of the named classes."""
    setting = spec.activation_checkpointing
    if setting is False:
        return []
    if setting is True:
        return units or _auto_units(module)
    return find_units(module, setting, field="activation_checkpointing")


def apply_checkpointing(modules: Sequence[nn.Module]) -> None:
    """Recompute each module's activations in backward (see the module docstring)."""
    from torch.utils.checkpoint import checkpoint

    for module in modules:
        original: Callable[..., Any] = module.forward

        def forward(*args: Any, __original: Callable[..., Any] = original,
                    **kwargs: Any) -> Any:
            return checkpoint(__original, *args, use_reentrant=False, **kwargs)

        module.forward = forward


def batchnorm_classes(module: nn.Module) -> list[str]:
    """Batch-norm classes in the model (their statistics are per local batch)."""
    return sorted({type(m).__name__ for m in module.modules() if isinstance(m, _BATCHNORM)})


def policies(spec: TrainSpec, device: torch.device) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for ``spec.fsdp``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    kwargs: dict[str, Any] = {"reshard_after_forward": spec.fsdp.reshard_after_forward}
    if spec.fsdp.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    # Pinned host memory needs an accelerator: without one, pin_memory=True fails in
    # fully_shard ("Cannot access accelerator device when none is available").
    kwargs["offload_policy"] = (CPUOffloadPolicy(pin_memory=device.type == "cuda")
                                if spec.fsdp.cpu_offload else OffloadPolicy())
    return kwargs


def shard(module: nn.Module, spec: TrainSpec, mesh: Any, device: torch.device) -> list[str]:
    """Apply activation checkpointing and ``fully_shard`` (units bottom-up, then the root) to
    ``module`` in place; returns the units' class names."""
    from torch.distributed.fsdp import fully_shard

    units = find_units(module, spec.fsdp.wrap)
    names = sorted({type(u).__name__ for u in units})  # fully_shard renames them FSDP<class>
    apply_checkpointing(checkpointed(module, spec, units))
    kwargs = policies(spec, device)
    for unit in reversed(units):  # inner units first when named classes nest
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return names


def sync_gradients(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """The context of one micro-batch's backward: DDP's ``no_sync()`` for all but a group's
    last, FSDP's ``set_requires_gradient_sync`` (gradients then stay unsharded until the last)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def local_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """This rank's part of every parameter (a DTensor's local shard, else the tensor)."""
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        yield p.to_local() if isinstance(p, DTensor) else p


def all_finite(module: nn.Module) -> bool:
    """Whether every weight this rank holds is finite (no NaN, no infinity).

    A finite sum holds neither: one pass that allocates nothing, 30x less than the
    element-wise mask in every checkpoint's step on a CPU (docs/performance.md, "Checkpoint
    stall ... session 2"); only a tensor whose sum is not finite (a NaN, or an overflow of
    finite values) is checked element by element."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
               for t in local_tensors(module))


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def build_sharded(spec: TrainSpec, make: Callable[[], nn.Module], *, rank: int, world: int,
                  device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """The model sharded over the ranks, with rank 0's real initial weights (see the module
    docstring); ``make`` runs the seeded factory. Returns the model and notes for people."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    notes: list[str] = []
    try:
        with torch.device("meta"):
            shell = make()
    except Exception as exc:  # a factory that loads files or computes on its tensors
        notes.append(f"the model factory cannot run on the meta device ({type(exc).__name__}: "
                     f"{exc}); every rank builds the whole model before it is sharded")
        module = make().to(device=device)
        if dtype != torch.float32:
            module.to(dtype=dtype)
        units = shard(module, spec, mesh, device)
        notes.append(f"FSDP units: {', '.join(units) or 'the whole model (no repeated blocks)'}")
        return module, notes
    real = make() if rank == 0 else None
    if dtype != torch.float32:  # as under DDP: fp32 leaves other dtypes' buffers alone
        shell.to(dtype=dtype)
        if real is not None:
            real.to(dtype=dtype)
    units = shard(shell, spec, mesh, device)
    shell.to_empty(device=device)
    full = {} if real is None else real.state_dict()
    set_model_state_dict(shell, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    # Buffers kept out of the state dict (persistent=False: rotary tables, masks) are not in
    # the broadcast; they are replicated, so rank 0's values go to every rank as they are.
    persistent = set(shell.state_dict())
    originals = dict(real.named_buffers()) if real is not None else {}
    for name, buffer in shell.named_buffers():
        if name in persistent:
            continue
        if real is not None:
            buffer.copy_(originals[name].to(buffer.device))
        if world > 1:
            dist.broadcast(buffer, src=0)
    del real, full
    notes.append(f"FSDP units: {', '.join(units) or 'the whole model (no repeated blocks)'}")
    return shell, notes


def weights_for(module: nn.Module, path: Path, where: str) -> tuple[dict[str, Any], list[str]]:
    """``init_from``'s weights for a sharded ``module``, read in this process (rank 0) and
    checked against the model's keys and shapes: the matching ones, and notes on the rest.
    Nothing matching, or a shape that differs, is a :class:`TrainFailure`."""
    from orchestrate.train import checkpoint

    loaded = checkpoint.model_state_of(checkpoint.load(path))
    expected = module.state_dict()
    aligned = checkpoint.align_keys(loaded, expected.keys())
    matching = {k: v for k, v in aligned.items() if k in expected}
    notes = []
    missing = sorted(set(expected) - aligned.keys())
    unexpected = sorted(aligned.keys() - set(expected))
    if missing:
        notes.append(f"{len(missing)} missing key(s): {', '.join(missing[:6])}")
    if unexpected:
        notes.append(f"{len(unexpected)} unexpected key(s): {', '.join(unexpected[:6])}")
    if not matching:
        raise TrainFailure(f"{where} does not fit the model: " + "; ".join(notes))
    wrong = [f"{k}: {tuple(v.shape)} in the file, {tuple(expected[k].shape)} in the model"
             for k, v in matching.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise TrainFailure(f"{where} does not fit the model: " + "; ".join(wrong[:3]))
    return matching, notes


def broadcast_weights(module: nn.Module, weights: dict[str, Any] | None) -> None:
    """Put rank 0's ``weights`` (None on the other ranks) into every rank's shards; keys not
    given keep their values (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, weights or {}, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))
