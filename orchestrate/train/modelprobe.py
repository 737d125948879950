"""The planner's look at the model: its size and layout, and traced steps on fake tensors.

``load`` (orchestrate/train/modelfacts.py) runs this in a child process, so that a slow or
failing user factory is bounded by a timeout and never crashes the plan::

    python -m orchestrate.train.modelprobe

It reads JSON lines on stdin and answers each with one line on stdout: its own pipe, for
whatever the user's code prints goes to stderr instead (:func:`_own_pipe`); a factory's
``sys.exit(N)`` is answered as that. The first request is the
job's ``train:`` section (``{"train": {...}}``); the answer is the model's facts, from the
factory run on the meta device (no memory): its parameter count, the module classes FSDP may
wrap, the units ``fsdp.wrap`` resolves to and the largest one's size, batch-norm classes. Then
each ``{"trace": LAYOUT, "world": W, "batch": B}`` is answered with the peak of one rank of W
training B samples per step under LAYOUT (``ddp``, ``ddp+ac``, ``fsdp``, ``fsdp+ac``): the model
is built again under ``FakeTensorMode`` (tensors with shapes and no storage), sharded with the
trainer's own code (:mod:`orchestrate.train.sharding`) over a mesh of W ranks of torch's
``fake`` process group, and one optimizer step on zero gradients (the optimizer's state) then one
training step on a batch shaped like the dataset's first sample run under torch's ``MemTracker``
(DDP) or ``FSDPMemTracker`` (FSDP), which count every tensor by what holds it (only the overall
peak is kept). A 67 M-parameter model traces in about a second (identical to the real step's
2,129 MiB, docs/train.md); a LLaMA-7B shape in 5-8 s a layout.

Failures are answers too (``{"error": ...}``; a wrong class name in ``fsdp.wrap`` comes back as
the problem to show), so the planner falls back to the formula and says why.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

_WEIGHTS = ("PARAM", "SHARDED_PARAM")
_GRADIENTS = ("GRAD", "SHARDED_GRAD")
_ACTIVATIONS = ("ACT", "TEMP", "INP")
_SHARDED = (*_WEIGHTS, *_GRADIENTS, "OPT")


#: Where answers go: the pipe that was stdout, kept apart from what the user's code prints
#: (:func:`_own_pipe`).
_answers: Any = None


def _say(message: dict[str, Any]) -> None:
    out = _answers or sys.stdout
    out.write(json.dumps(message) + "\n")
    out.flush()


def _own_pipe() -> None:
    """Answer on a copy of the stdout pipe, and point stdout (fd 1, and so ``print`` and any
    process the factory starts) at stderr: a factory that prints no longer breaks the answers."""
    import os

    global _answers
    sys.stdout.flush()
    _answers = os.fdopen(os.dup(1), "w")  # not inherited (PEP 446): only this process answers
    os.dup2(2, 1)


def facts(spec: Any) -> dict[str, Any]:
    """The model's facts, built on the meta device (see the module docstring)."""
    import torch

    from orchestrate.core.errors import UserError
    from orchestrate.train import sharding
    from orchestrate.train.build import _made

    with torch.device("meta"):
        model = _made(spec)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    answer: dict[str, Any] = {
        "params": float(params), "classes": sharding.class_names(model),
        "batchnorm": sharding.batchnorm_classes(model),
    }
    try:
        units = sharding.find_units(model, spec.fsdp.wrap)
        sharding.checkpointed(model, spec, units)
    except UserError as exc:
        problem = exc.problems[0]
        answer["problem"] = {"field": problem.field, "message": problem.message,
                             "got": problem.got, "hint": problem.hint}
        return answer
    answer["wrap_classes"] = sorted({type(u).__name__ for u in units})
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    answer["largest_unit"] = float(max(sizes)) if sizes else float(params)
    return answer


def _sample(spec: Any) -> tuple[Any, ...]:
    """The dataset's first training sample (input, target), real tensors."""
    import torch

    from orchestrate.train import factories, rng
    from orchestrate.train.build import _datasets

    rng.seed_all(spec.seed)
    train_set, _ = _datasets(spec, factories.call(spec.dataset, "dataset factory",
                                                  dict(spec.dataset_args)))
    item = train_set[0]
    values = tuple(item)[:2]
    return tuple(v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values)


def _mesh(world: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and dist.get_world_size() != world:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return init_device_mesh("cpu", (world,))


def _peak_only(tracker: Any) -> Any:
    """``tracker`` (a torch memory tracker class) keeping only the overall peak, and the moment
    the most memory is held by what a rank does not shard (``busiest``).

    The stock trackers also keep a peak snapshot for every module active at every operator, a
    loop over all modules per operator: most of a 7B-shaped model's trace time. The planner
    reads only the overall peak, which the stock code computes the same way, and the busiest
    moment: a trace at 2 ranks peaks where the states are (the optimizer step) when at 8 ranks,
    whose shards are a quarter as big, the end of the forward pass (the activations) is the
    peak; the planner carries both moments over and keeps the larger.
    """

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class PeakOnly(tracker):  # type: ignore[misc]
        busiest: dict[Any, dict[Any, int]]
        _busiest_bytes: dict[Any, int]

        def _update_peak_stats(self, peak_state: Any) -> None:
            if not hasattr(self, "busiest"):
                self.busiest, self._busiest_bytes = {}, {}
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)
                held = dev_snap[_TOTAL_KEY] - sum(
                    v for k, v in dev_snap.items() if getattr(k, "name", "") in _SHARDED)
                if self._busiest_bytes.get(dev, -1) < held:
                    self._busiest_bytes[dev] = held
                    self.busiest[dev] = dict(dev_snap)

    return PeakOnly


def _tracker(strategy: str, model: Any, optimizer: Any, inputs: Any) -> Any:
    """The memory tracker of ``strategy`` (peak only), given what it counts."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if strategy == "fsdp":
        tracker = _peak_only(FSDPMemTracker)(model, optimizer)
        tracker.track_inputs((inputs,))
    else:
        tracker = _peak_only(MemTracker)()
        tracker.track_external(model, optimizer)
    return tracker


def _zero_gradients(optimizer: Any) -> None:
    import torch

    for param in (p for group in optimizer.param_groups for p in group["params"]):
        param.grad = torch.zeros_like(param)


def _cast(model: Any, dtype: Any) -> None:
    """``model.to(dtype=dtype)`` for a model of fake tensors (``bf16-true``).

    ``Module.to`` swaps every fake parameter in place (``torch.utils.swap_tensors``), which fake
    tensors refuse ("Couldn't swap Embedding.weight": the fake mode keeps weak references to
    them); new parameters are put in their place instead, one per parameter so that tied
    weights stay tied, and floating-point buffers are cast as ``to`` casts them.
    """
    import torch

    made: dict[int, Any] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(param.detach().to(dtype),
                                                     requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


def trace(spec: Any, layout: str, world: int, batch: int, sample: tuple[Any, ...]
          ) -> dict[str, Any]:
    """One rank's traced peak (bytes by what holds them) under ``layout``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orchestrate.core.plan.memory import OPTIONS
    from orchestrate.train import sharding
    from orchestrate.train.build import _made
    from orchestrate.train.losses import resolve_loss
    from orchestrate.train.optimizer import build_optimizer
    from orchestrate.train.precision import plan_precision

    strategy, checkpointed = OPTIONS[layout]
    spec = spec.model_copy(update={"strategy": strategy, "activation_checkpointing": (
        spec.activation_checkpointing if spec.activation_checkpointing is not False
        else checkpointed)})
    started = time.perf_counter()
    mesh = _mesh(world) if strategy == "fsdp" else None
    device = torch.device("cpu")
    precision = plan_precision(spec, device)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        model = _made(spec)
        if precision.param_dtype != torch.float32:
            _cast(model, precision.param_dtype)
        if strategy == "fsdp":
            sharding.shard(model, spec, mesh, device)
        else:
            sharding.apply_checkpointing(sharding.checkpointed(model, spec, []))
        optimizer = build_optimizer(spec.optimizer, [p for p in model.parameters()
                                                     if p.requires_grad])
        inputs: Any
        target: Any
        inputs, target = (mode.from_tensor(t) for t in list(sample)[:2])  # a weight: unused
        inputs = precision.cast_input(inputs.unsqueeze(0).expand(batch, *inputs.shape).clone())
        target = target.unsqueeze(0).expand(batch, *target.shape).clone()
        loss_fn = resolve_loss(spec.loss)
        # The optimizer's state comes from a tracked first step on zero gradients (the trackers
        # count them as gradients; AdamW's first step holds more temporaries than later ones and
        # can be the peak), with no forward and backward traced for it: the traced training step
        # then has the state, as every later step of a run does (docs/performance.md).
        _zero_gradients(optimizer)
        tracker = _tracker(strategy, model, optimizer, inputs)
        with tracker:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast():
                loss = loss_fn(model(inputs), target)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    parts = _parts(peak, layout, world, batch, time.perf_counter() - started)
    busiest = _parts(getattr(tracker, "busiest", {}), layout, world, batch, 0.0)
    parts["busiest"] = [busiest[k] for k in ("weights", "gradients", "optimizer", "gathered",
                                             "activations")]
    return parts


def _parts(peak: dict[Any, dict[Any, int]], layout: str, world: int, batch: int,
           seconds: float) -> dict[str, Any]:
    """The tracker's categories summed into the plan's parts."""
    by_name: dict[str, float] = {}
    for stats in peak.values():
        for kind, value in stats.items():
            name = getattr(kind, "name", str(kind))
            by_name[name] = by_name.get(name, 0.0) + float(value)
    by_name.pop("Total", None)
    weights = sum(by_name.pop(k, 0.0) for k in _WEIGHTS)
    gradients = sum(by_name.pop(k, 0.0) for k in _GRADIENTS)
    optimizer = by_name.pop("OPT", 0.0)
    activations = sum(by_name.pop(k, 0.0) for k in _ACTIVATIONS)
    return {"option": layout, "world_size": world, "batch": batch, "weights": weights,
            "gradients": gradients, "optimizer": optimizer,
            "gathered": sum(by_name.values()), "activations": activations,
            "seconds": round(seconds, 3)}


def _brief(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def main() -> int:
    """Answer the requests on stdin (see the module docstring)."""
    import os

    _own_pipe()
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        from orchestrate.core.spec.trainspec import TrainSpec

        first = json.loads(sys.stdin.readline() or "{}")
        spec = TrainSpec.model_validate(first["train"])
        _say({"facts": facts(spec)})
    except ImportError as exc:
        _say({"error": f"torch is not installed here ({_brief(exc)})", "kind": "import"})
        return 0
    except SystemExit as exc:  # the user's factory called sys.exit(): that is the answer
        _say({"error": f"the model factory called sys.exit({exc.code!r})"})
        return 0
    except Exception as exc:
        _say({"error": _brief(exc)})
        return 0
    sample: tuple[Any, ...] | None = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if sample is None:
                sample = _sample(spec)
            _say({"traced": trace(spec, request["trace"], int(request["world"]),
                                  int(request["batch"]), sample)})
        except SystemExit as exc:
            _say({"error": f"a factory called sys.exit({exc.code!r})"})
        except Exception as exc:
            if os.environ.get("ORCHESTRATE_PROBE_DEBUG"):
                traceback.print_exc()
            _say({"error": _brief(exc)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
