"""Where a run computes and in which precision, decided once (DESIGN principle 9).

A :class:`Placement` holds the run's device, the dtype of its parameters, updates, aggregation and state,
and the dtype local training and evaluation autocast to (``precision: bf16-mixed``). The run context
resolves it once from the config (``device``, ``precision``, ``memory``), and the execution and algorithm
layers make every tensor from it. This is the only module that asks torch which devices exist.

Random streams stay on the CPU (``fedweave.seeding`` gives CPU generators): draws are made there and then
moved, so one seed gives the same sampling, partitions, batch order and perturbations on every device.

Data and per-client state live on the device when they fit in a configured fraction of its free memory,
otherwise in pinned host memory from which only the rows a step needs are copied (non-blocking). On a CPU
every one of these is the identity: a CPU run computes exactly what it computed before placements existed.
"""

from __future__ import annotations

import contextlib
import os
import platform
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from fedweave.config import ConfigError, MemoryConfig

AUTOCAST = {"bf16-mixed": torch.bfloat16}
VMAP_CHUNK_CPU = 64  # jobs per batched computation on a CPU: the local trainer's default before placements existed
VMAP_CHUNK_MAX = 4096
_NULL = contextlib.nullcontext()


class DeviceMemoryError(ConfigError):
    """The device ran out of memory; the message names what was being computed and the knob to turn."""


def available_devices() -> list[str]:
    """The devices of this machine that torch can use, CPU first."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def resolve_device(requested: str) -> torch.device:
    """``auto`` -> cuda if available, else mps, else cpu; a named device must exist on this machine."""
    have = available_devices()
    if requested == "auto":
        accel = [d for d in have if d != "cpu"]
        return torch.device(accel[0] if accel else "cpu")
    name = "cuda:0" if requested == "cuda" else requested
    if name not in have:
        raise ConfigError(
            f"device: {requested!r} is not available on this machine (available: {', '.join(have)}); "
            "set device: auto or one of those"
        )
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """What the device is, in words (for summary.json)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    return platform.processor() or platform.machine() or "cpu"


def take_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` for an integer index tensor of any shape: the same rows, copied by ``index_select``, which on
    a CPU copies whole rows where advanced indexing computes an offset per element (a step's 10 MNIST rows:
    12 vs 44 us; the 50 jobs' rows of a vmap step: 265 vs 392 us; docs/performance.md). Boolean
    masks take ordinary indexing. The indices are sample positions, never negative (``index_select`` rejects
    a negative one)."""
    if idx.dtype == torch.bool:
        return t[idx]
    return t.index_select(0, idx.reshape(-1)).view(idx.shape + t.shape[1:])


@dataclass(eq=False)
class Placement:
    """The run's device, storage dtype and autocast dtype, and where its data and state live."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32  # parameters, updates, aggregation, per-client state, checkpoints
    precision: str = "float32"  # as configured: float32, float64 or bf16-mixed
    name: str = "cpu"
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # set by a family that computes in another dtype than the configured one (the confederated family's
    # float64 problems), so that summary.json says what the run computed in
    computes_in: str | None = None
    # tensors already placed: id -> (weak reference to the source, its placed copy)
    _placed: dict[int, tuple[Any, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.on_cpu = self.device.type == "cpu"  # read on every batch: a plain attribute

    def __reduce__(self):  # sent to worker processes without the placed copies
        return (Placement, (self.device, self.dtype, self.precision, self.name, self.memory))

    # ---- what it is -------------------------------------------------------------------------------
    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype local training and evaluation compute in (bfloat16 under bf16-mixed), else None."""
        return AUTOCAST.get(self.precision)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for a forward and backward pass under bf16-mixed (parameters stay in ``dtype``)."""
        dt = self.autocast_dtype
        return _NULL if dt is None else torch.autocast(self.device.type, dtype=dt)

    def summary(self) -> dict[str, str]:
        """The placement for summary.json: device, its name, the configured precision and, where a family
        computes in another dtype, ``computes_in``."""
        out = {"device": str(self.device), "device_name": self.name, "precision": self.precision}
        if self.computes_in is not None and self.computes_in != self.precision:
            out["computes_in"] = self.computes_in
        return out

    def check_float64(self, what: str) -> None:
        """``what`` computes in float64, which MPS lacks: a configuration error there."""
        if self.device.type == "mps":
            raise ConfigError(f"device: mps has no float64, which {what} computes in; use device: cpu or cuda")

    # ---- making and moving tensors ------------------------------------------------------------------
    def to(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device (a non-blocking copy from pinned memory; ``t`` itself when already there)."""
        return t.to(self.device, non_blocking=True)

    @staticmethod
    def host(t: torch.Tensor) -> torch.Tensor:
        """``t`` in host memory (for numpy, the object store, a checkpoint)."""
        return t.detach().cpu()

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in page-locked host memory where the device copies from it asynchronously (CUDA)."""
        if self.device.type != "cuda" or t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()

    def data(self, t: torch.Tensor) -> torch.Tensor:
        """A dataset tensor where the computation is: on the device once, if it fits in ``data_fraction``
        of the free device memory; else in pinned host memory (batches are gathered there and copied).
        The same tensor asked for again gets the same placed copy."""
        if t.device == self.device or (self.on_cpu and t.device.type == "cpu"):
            return t
        key = id(t)
        hit = self._placed.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        if t.device.type != "cpu":  # on another accelerator: bring it home first
            t_host = t.cpu()
        else:
            t_host = t
        if self.fits(t_host.numel() * t_host.element_size(), self.memory.data_fraction):
            placed = t_host.to(self.device)
        else:
            placed = self.pinned(t_host)
        self._placed[key] = (weakref.ref(t), placed)
        weakref.finalize(t, self._placed.pop, key, None)
        return placed

    def rows(self, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` of a placed tensor, on the device: gathered there when ``t`` lives there, else
        gathered in host memory and copied without blocking."""
        if self.on_cpu:
            return take_rows(t, idx)
        if t.device == self.device:
            return take_rows(t, idx.to(self.device, non_blocking=True))
        rows = take_rows(t, idx.cpu())
        return (
            rows.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else rows.to(self.device)
        )

    def state_device(self, nbytes: int) -> torch.device:
        """Where per-client state of ``nbytes`` lives: the device when it fits in ``state_fraction`` of the
        free device memory, else the host."""
        return self.device if self.fits(nbytes, self.memory.state_fraction) else torch.device("cpu")

    # ---- memory -----------------------------------------------------------------------------------
    def free_bytes(self) -> int | None:
        """Free device memory in bytes; None on a CPU (host memory is not budgeted here)."""
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        if self.device.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
        return None

    def fits(self, nbytes: int, fraction: float) -> bool:
        free = self.free_bytes()
        return free is None or nbytes <= fraction * free

    def vmap_chunk(self, per_job_bytes: int | None = None) -> int:
        """Jobs per batched computation: ``memory.vmap_chunk`` if set; 64 on a CPU; on an accelerator as
        many jobs of ``per_job_bytes`` as fit in half the free memory, at most ``VMAP_CHUNK_MAX`` (8 until that
        is measured)."""
        if self.memory.vmap_chunk is not None:
            return self.memory.vmap_chunk
        free = self.free_bytes()
        if free is None:
            return VMAP_CHUNK_CPU
        if not per_job_bytes:
            return 8
        return max(1, min(VMAP_CHUNK_MAX, int(0.5 * free // per_job_bytes)))

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        """The most device memory allocated since :meth:`reset_peak` (0 on a CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.device.type == "mps":
            return int(torch.mps.current_allocated_memory())
        return 0

    def allocated_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        if self.device.type == "mps":
            return int(torch.mps.current_allocated_memory())
        return 0

    def synchronize(self) -> None:
        """Wait for the device's queued work (timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    @contextlib.contextmanager
    def out_of_memory(self, what: str, knob: str) -> Any:
        """Turn a device out-of-memory error inside the block into one line naming ``what`` and ``knob``."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            raise DeviceMemoryError(f"out of memory on {self.device} ({self.name}) while {what}; {knob}") from e
        except RuntimeError as e:
            if "out of memory" not in str(e).lower():
                raise
            raise DeviceMemoryError(f"out of memory on {self.device} ({self.name}) while {what}; {knob}") from e


CPU = Placement()  # where code built without a run context computes (tests, benchmarks, deployment clients)


def resolve_placement(device: str, precision: str, memory: MemoryConfig | None = None) -> Placement:
    """The placement of a run with these config values; a device this machine lacks is a ConfigError."""
    dev = resolve_device(device)
    if precision == "float64" and dev.type == "mps":
        raise ConfigError("precision: float64 is not supported on device mps (MPS has no float64); use float32")
    dtype = torch.float64 if precision == "float64" else torch.float32
    if dev.type == "cuda":
        reproducible_on_cuda()
    if dev.type == "cuda" and precision != "bf16-mixed":
        full_float32_on_cuda()
    return Placement(dev, dtype, precision, device_name(dev), memory or MemoryConfig())


def reproducible_on_cuda() -> None:
    """The same seed gives the same numbers on a CUDA device, run after run. cuDNN's default convolution
    algorithms may sum a weight gradient with atomic adds, in whatever order the threads finish: two runs of the
    same MNIST CNN config on one H200 ended 0.04 points of accuracy apart (docs/performance.md, GPUs). cuDNN then
    picks deterministic algorithms and does not time candidates per shape (benchmark mode chooses by timing, so
    by load), and cuBLAS gets a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when the process creates its
    handles; kept where the environment sets it). Process-wide switches, as TF32's."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def full_float32_on_cuda() -> None:
    """``precision: float32`` on a CUDA device computes in float32. cuDNN's default runs convolutions in TF32 (a
    10-bit mantissa): on an H100 two programs computing the same CNN round differed by 8e-4 (relative) after
    one round, 5e-8 with TF32 off (docs/performance.md, GPUs). These are torch's process-wide switches."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def move_tensors(obj: Any, device: torch.device, _seen: dict[int, Any] | None = None) -> Any:
    """A copy of ``obj`` (a tensor, or containers and plain objects holding tensors, such as a local rule)
    with every tensor on ``device``; other values are shared. For rules sent to worker processes: they
    travel on the host and compute where their worker computes."""
    seen = {} if _seen is None else _seen
    if id(obj) in seen:
        return seen[id(obj)]
    if isinstance(obj, torch.Tensor):
        out: Any = obj.to(device)
    elif isinstance(obj, list):
        out = [move_tensors(v, device, seen) for v in obj]
    elif isinstance(obj, tuple):
        out = tuple(move_tensors(v, device, seen) for v in obj)
    elif isinstance(obj, dict):
        out = {k: move_tensors(v, device, seen) for k, v in obj.items()}
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)) and not callable(obj):
        out = obj.__class__.__new__(obj.__class__)  # the same class, its attributes set below
        seen[id(obj)] = out
        for k, v in vars(obj).items():
            setattr(out, k, move_tensors(v, device, seen))
        return out
    else:
        out = obj
    seen[id(obj)] = out
    return out
