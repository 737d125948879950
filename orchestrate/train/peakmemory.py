"""Each rank's measured peak memory: what the machine saw, to compare with the plan's estimate.

On a GPU it is ``torch.cuda.max_memory_allocated`` (the caching allocator's tensors; the CUDA
context and NCCL's buffers are not in it). On a CPU rank it is the peak resident memory of the
process above its resident memory just before the model is built: at that moment the peak
("high water mark", ``VmHWM``) is reset to the current size through ``/proc/self/clear_refs``,
and glibc is told to give large freed blocks back to the system at once (``mallopt``:
allocations of 64 KiB and more are their own mappings, and free memory is trimmed), so a tensor
freed and a later one allocated do not both stay resident. Page granularity and the allocator's
bookkeeping stay in the figure, as they do on the machine.

Where ``/proc`` cannot be written, ``getrusage``'s lifetime peak minus the baseline is used.

Those malloc settings cost speed: every block of 64 KiB or more is mapped and unmapped (and its
pages zeroed) each time, and FSDP allocates and frees each unit's gathered parameters every step
(measured: FSDP samples/s 0.62 of a hand-written loop with them for the whole run). So on a CPU
rank the peak is measured over the model's building and the first ``MEASURED_STEPS`` optimizer
steps (the first step allocates the optimizer state; later steps repeat the same pattern), then
frozen, and glibc gets settings near its defaults back. A later, larger peak (validation with a
bigger batch, say) is not in the CPU figure; on a GPU the peak covers the whole run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from pathlib import Path

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_STATUS = Path("/proc/self/status")


def _status_kib(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


#: Optimizer steps over which a CPU rank's peak is measured (see the module docstring).
MEASURED_STEPS = 3


def _malloc(mmap_threshold: int, trim_threshold: int) -> None:
    """Set glibc's mmap and trim thresholds (harmless where it is not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    except (OSError, AttributeError):
        pass


def _return_freed_memory() -> None:
    """Ask glibc to unmap large freed blocks at once."""
    _malloc(64 * 1024, 128 * 1024)


def _keep_freed_memory() -> None:
    """glibc's dynamic thresholds' upper ends: freed blocks below 32 MiB are reused."""
    _malloc(32 * 1024 * 1024, 64 * 1024 * 1024)


class PeakMemory:
    """One rank's peak, measured from :meth:`start` (call it just before building the model)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline_kib = 0
        self._resettable = False
        self._steps = 0
        self._frozen: float | None = None

    def start(self) -> None:
        """Take the baseline and reset the peak to it."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _return_freed_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._resettable = True
        except OSError:
            self._resettable = False
        self.baseline_kib = _status_kib("VmRSS") or 0

    def step_done(self) -> None:
        """An optimizer step is done; after ``MEASURED_STEPS`` a CPU rank's peak is frozen and
        the malloc settings relaxed."""
        self._steps += 1
        if self.device.type != "cuda" and self._steps == MEASURED_STEPS:
            self._frozen = self.peak_bytes()
            _keep_freed_memory()

    def peak_bytes(self) -> float:
        """The peak since :meth:`start`, in bytes above the baseline (0 if unknown)."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        if self._frozen is not None:
            return self._frozen
        peak = _status_kib("VmHWM") if self._resettable else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return max(0.0, (peak - self.baseline_kib) * 1024.0)
