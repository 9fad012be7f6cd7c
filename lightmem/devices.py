"""How fast a training device computes and moves bytes: the prices of every plan and estimate.

A step's time is priced op by op from the fake step's trace, each op by its class:

- matrix products, convolutions and fused attention by their FLOPs, at the device's matrix rate
  for the op's dtype (fp32 products at the fp32 rate unless TF32 is allowed, as torch decides:
  ``torch.backends.cuda.matmul.allow_tf32`` for products, ``torch.backends.cudnn.allow_tf32`` for
  convolutions), times an efficiency for the class;
- every other op (norms, activations, dropout, residual adds, the optimizer's foreach kernels,
  casts, the loss) by the bytes it reads and writes, at the device's memory bandwidth;
- no kernel faster than ``kernel_s``; view ops cost nothing.

The rates come from one of two places. ``gpu="h100"`` (and the other names of ``GPU_TABLE``)
looks the device up: datasheet peaks times ``TABLE_EFFICIENCY``, and the host link as measured on
that generation of PCIe. ``measure_device_speeds(device)`` measures the training device itself at
fit start (a page-locked copy each way, a large matrix product per dtype, a device-to-device copy;
well under a second): what ``LightMem(plan="auto")`` prices with. ``gpu="auto"`` (the default)
is the CUDA device of this machine when there is one, else the generic ``default`` entry.

The class efficiencies are module constants, not per-model fits. They were set from an H100's
per-op profile (``benchmarks/op_prices.py --measure``: each op's device time beside its price) and
checked against every step measured on an H100 and an H200 so far (docs/planner.md, "Calibration
and accuracy").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

MATMUL, CONVOLUTION, ATTENTION, MEMORY = "matmul", "convolution", "attention", "memory"
REDUCTION = "reduction"
"""The op classes a step is priced by (``REDUCTION``: memory-bound ops that pass over their input
more than once or reduce across rows: norms' statistics and backward, sums, pooling's backward)."""

MISALIGNED = "misaligned matmul"
CLASS_EFFICIENCY = {MATMUL: 0.95, CONVOLUTION: 0.27, ATTENTION: 0.50, MISALIGNED: 0.12}
"""Share of the device's large-GEMM rate each class sustains in an eager training step (products
of a model's sizes, fp32 convolutions in NCHW through cuDNN's TF32, fused attention forward and
backward, and products with a dimension the tensor cores cannot tile, such as a vocabulary of
50257): calibrated, see the module docstring."""
MEMORY_EFFICIENCY = 0.95
"""Share of the memory bandwidth (a device-to-device copy's, bytes read plus written) the
elementwise ops of an eager training step sustain: casts, activations, residual adds, the fused
optimizer. Profiled op by op on an H100 (docs/gpu-runs/2026-11-27-h100-op-prices.txt): the GPT's
and ResNet-50's elementwise ops ran at 0.8-0.95 of their price at this share."""
REDUCTION_EFFICIENCY = 0.40
"""The same for ``REDUCTION`` ops, counted by the bytes they read and write once: BatchNorm's
forward and backward, LayerNorm's backward, ``sum`` over rows and max-pooling's backward ran at
0.84-1.2 of their price at this share on the H100 (the same profile)."""
TABLE_EFFICIENCY = 0.70
"""Share of a datasheet's dense peak the product ``measure_device_speeds`` times (4096 cubed) reaches:
695 of 989 TFLOP/s in bf16 on an H200 (torch 2.11), so table and measured speeds are the same kind."""
TABLE_MEMORY_EFFICIENCY = 0.86
"""Share of a datasheet's memory bandwidth a large device-to-device copy reaches (4.15 of 4.8 TB/s
on an H200, bytes read plus written; about 3.0 of 3.35 on an H100)."""
HOST_OP_S = 50e-6
"""Host time per priced op of an eager step: its launch and what the host does around it (views,
autograd's and autocast's bookkeeping, the model's Python). A step of many small ops is bound by it.
Measured on the H100 of 2026-11-27 (docs/gpu-runs/2026-11-27-h100-run3-frontier.txt): GPT-2 from its
default config at batch 3 (1,002 priced ops) took 49.9 ms a step with its device work priced at
29.6 ms, steps varying by 20% and its time per sample falling with the batch: host-bound. Every
device-bound step measured that day stays so at this price (the 16-block GPT's 841 ops: 42 ms of
host under 51 ms of device). It was 6 us, assumed; ``benchmarks/op_prices.py --measure`` times the
host issuing a step beside it."""

CHECKPOINT_HOST_SHARE = 0.55
"""A checkpointed block's bookkeeping on the host (``torch.utils.checkpoint``'s context, its pack and
unpack hooks, the RNG state), in host ops per op of the block's forward, paid in backward beside the
re-run's own launches. Calibrated on the H100 of 2026-11-27: GPT-2 at batch 6 with 11 of its 12 blocks
checkpointed took 78.2 ms a step, host-bound (``HOST_OP_S``), where re-launching their 33 ops each
prices 68.3 ms."""
POLICY_HOST_SHARE = 1.05
"""An op-level policy's (selective checkpointing's) Python per op of a checkpointed block, in host
ops, paid in its forward and again in its re-run: the policy sees every op twice. Calibrated on the
same H100: GPT-2 at batch 4 with 7 blocks under ``save_matmuls`` took 90.9 ms a step."""


def checkpoint_host_seconds(host_op_s: float, forward_ops: int, rerun_ops: int, op_policy: bool) -> tuple[float, float]:
    """The host's time a checkpointed block adds, (in its forward, in its backward), at
    ``host_op_s`` per op: the re-run's ``rerun_ops`` launched again, checkpointing's bookkeeping
    (``CHECKPOINT_HOST_SHARE``) and, under an op-level policy, the policy's Python for each of the
    block's ``forward_ops`` in both passes (``POLICY_HOST_SHARE``)."""
    policy = POLICY_HOST_SHARE * forward_ops if op_policy else 0.0
    backward = rerun_ops + CHECKPOINT_HOST_SHARE * forward_ops + policy
    return policy * host_op_s, backward * host_op_s


GIB = 1 << 30


@dataclass(frozen=True)
class DeviceSpeeds:
    """The rates one device is priced at.

    ``matmul_flops_per_s`` holds the rate of a large matrix product per dtype name ("fp32",
    "tf32", "bf16", "fp16", "fp64"); ``memory_bytes_per_s`` the device memory's bandwidth (bytes
    read plus written); ``to_host_bytes_per_s`` / ``to_device_bytes_per_s`` the page-locked host
    link each way. ``source`` says where the figures came from, for reports.
    """

    name: str
    matmul_flops_per_s: Mapping[str, float]
    memory_bytes_per_s: float
    to_host_bytes_per_s: float
    to_device_bytes_per_s: float
    kernel_s: float = 3e-6
    host_op_s: float = HOST_OP_S
    source: str = ""
    hopper: bool = False
    """Compute capability 9.0: cuBLAS keeps 32 MiB workspaces there (``cuda_model``)."""
    block_scale: Mapping[str, float] = field(default_factory=dict)
    """Per block (its module name), measured seconds over priced seconds of its compute:
    ``plan="auto"`` times each block's forward with CUDA events in the first steps of a plan and
    plans again with these when a block is off its price (``with_block_scale``). Empty: as priced."""

    @property
    def link_bytes_per_s(self) -> float:
        """The slower direction of the host link: what a transfer both ways is bound by."""
        return min(self.to_host_bytes_per_s, self.to_device_bytes_per_s)

    def with_overrides(self, *, flops_per_s: float | None = None, link_bytes_per_s: float | None = None) -> DeviceSpeeds:
        """These speeds with every matrix rate set to ``flops_per_s`` and both link directions to
        ``link_bytes_per_s`` (each when given): ``plan(flops_per_s=..., link_bytes_per_s=...)``."""
        speeds = self
        if flops_per_s is not None:
            rates = dict.fromkeys(self.matmul_flops_per_s, float(flops_per_s))
            speeds = replace(speeds, matmul_flops_per_s=rates, source=f"{speeds.source}; {flops_per_s:g} FLOP/s given")
        if link_bytes_per_s is not None:
            link = float(link_bytes_per_s)
            speeds = replace(
                speeds, to_host_bytes_per_s=link, to_device_bytes_per_s=link,
                source=f"{speeds.source}; link {link / 1e9:g} GB/s given",
            )  # fmt: skip
        return speeds

    def with_pace(self, pace: float, note: str) -> DeviceSpeeds:
        """These speeds with the device's compute (matrix rates and memory bandwidth, not the host
        link) and the host's launches ``pace`` times as fast: what a measured step says of the
        machine. Both move together, so a step that waits on the host is priced as measured too,
        and a step keeps whichever of the two bounds it."""
        rates = {name: rate * pace for name, rate in self.matmul_flops_per_s.items()}
        return replace(
            self, matmul_flops_per_s=rates, memory_bytes_per_s=self.memory_bytes_per_s * pace,
            host_op_s=self.host_op_s / pace, source=f"{self.source}; {note}",
        )  # fmt: skip

    def with_host_scale(self, scale: float, note: str) -> DeviceSpeeds:
        """These speeds with the host's launches priced ``scale`` times as long (``host_op_s``):
        what blocks whose forward waited on the host measured."""
        return replace(self, host_op_s=self.host_op_s * scale, source=f"{self.source}; {note}")

    def with_block_scale(self, scale: Mapping[str, float], note: str) -> DeviceSpeeds:
        """These speeds with each named block's compute priced ``scale[name]`` times as long (its
        measured forward over its priced one); other blocks as they were."""
        return replace(self, block_scale={**self.block_scale, **scale}, source=f"{self.source}; {note}")

    def matmul_rate(self, dtype_name: str) -> float:
        rates = self.matmul_flops_per_s
        return rates.get(dtype_name) or rates.get("fp32") or min(rates.values())

    def host_seconds(self, priced_ops: int) -> float:
        """The host's time to issue a step of ``priced_ops`` ops (``host_op_s`` each): the least
        such a step takes however fast the device is."""
        return priced_ops * self.host_op_s

    def op_seconds(self, kind: str, dtype_name: str, flops: float, nbytes: int) -> float:
        """One op's device time: its class's rate, never under its memory traffic or one kernel."""
        if kind == REDUCTION:
            return max(nbytes / (self.memory_bytes_per_s * REDUCTION_EFFICIENCY), self.kernel_s)
        memory_s = nbytes / (self.memory_bytes_per_s * MEMORY_EFFICIENCY)
        if kind == MEMORY or not flops:
            return max(memory_s, self.kernel_s)
        compute_s = flops / (self.matmul_rate(dtype_name) * CLASS_EFFICIENCY[kind])
        return max(compute_s, memory_s, self.kernel_s)

    def describe(self) -> str:
        """``H100 SXM (table: datasheet peaks): fp32 46.9 TFLOP/s, ..., bf16 692 TFLOP/s, ..., memory 2.88
        TB/s, host link 51.1 GiB/s to host, 51.1 GiB/s back``; a CPU's ``fp32 200 GFLOP/s, ..., memory
        6.6 GB/s`` (``format_rate``: three significant figures at every scale)."""
        rates = ", ".join(f"{name} {format_rate(rate, 'FLOP/s')}" for name, rate in self.matmul_flops_per_s.items())
        return (
            f"{self.name} ({self.source}): {rates}, memory {format_rate(self.memory_bytes_per_s, 'B/s')}, host link "
            f"{format_rate(self.to_host_bytes_per_s, 'B/s', binary=True)} to host, "
            f"{format_rate(self.to_device_bytes_per_s, 'B/s', binary=True)} back"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "matmul_flops_per_s": dict(self.matmul_flops_per_s),
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "to_host_bytes_per_s": self.to_host_bytes_per_s,
            "to_device_bytes_per_s": self.to_device_bytes_per_s,
            "kernel_s": self.kernel_s,
            "host_op_s": self.host_op_s,
            "hopper": self.hopper,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpeeds:
        """The speeds ``to_dict`` wrote (a JSON file of one GPU's measured figures, for pricing on
        another machine); ``kernel_s``, ``host_op_s`` and ``hopper`` may be absent (defaults)."""
        known = ("kernel_s", "host_op_s", "hopper")
        return cls(
            str(data["name"]), {str(k): float(v) for k, v in data["matmul_flops_per_s"].items()},
            float(data["memory_bytes_per_s"]), float(data["to_host_bytes_per_s"]),
            float(data["to_device_bytes_per_s"]), source=str(data.get("source", "")),
            **{key: data[key] for key in known if key in data},
        )  # fmt: skip


def format_rate(per_s: float, unit: str, *, binary: bool = False) -> str:
    """A rate with three significant figures at every scale, in the largest unit up to tera that
    keeps a figure of at least 1: ``format_rate(791e12, "FLOP/s")`` is ``"791 TFLOP/s"``, a CPU's
    0.2e12 ``"200 GFLOP/s"``, 6.6e9 B/s ``"6.6 GB/s"``; ``binary``: powers of 1024 (``"51.1 GiB/s"``).
    Figures of 1000 and more in tera are written whole (``"2,250 TFLOP/s"``)."""
    base = 1024.0 if binary else 1000.0
    value, prefix = float(f"{per_s:.3g}"), ""  # rounded first: 999.6e9 is "1 TFLOP/s", not "1,000 GFLOP/s"
    for step in ("k", "M", "G", "T"):
        if abs(value) < base:
            break
        value, prefix = value / base, step
    if prefix and binary:
        prefix = ("K" if prefix == "k" else prefix) + "i"
    number = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{number} {prefix}{unit}"


@dataclass(frozen=True)
class _Datasheet:
    """Dense peaks (TFLOP/s), memory bandwidth (TB/s) and the host link (GB/s each way, as measured
    on that link generation with page-locked memory)."""

    title: str
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    memory_tb_s: float
    link_gb_s: float
    hopper: bool = False
    names: tuple[str, ...] = field(default=())

    def speeds(self) -> DeviceSpeeds:
        rates = {
            name: peak * 1e12 * TABLE_EFFICIENCY
            for name, peak in (("fp32", self.fp32), ("tf32", self.tf32), ("bf16", self.bf16), ("fp16", self.fp16))
        }
        link = self.link_gb_s * 1e9
        return DeviceSpeeds(
            self.title, rates, self.memory_tb_s * 1e12 * TABLE_MEMORY_EFFICIENCY, link, link,
            source="table: datasheet peaks", hopper=self.hopper,
        )  # fmt: skip


_PCIE5, _PCIE4, _PCIE3 = 54.9, 25.0, 12.0
"""Page-locked copies each way: PCIe Gen5 x16 measured 51.1 GiB/s on an H100 here; Gen4 and Gen3
at the same share of their line rate."""

_SHEETS = (
    _Datasheet("H100 SXM", 67, 495, 989, 989, 3.35, _PCIE5, True, ("hopper", "sm90", "h100", "h800")),
    _Datasheet("H100 PCIe", 51, 378, 756, 756, 2.0, _PCIE5, True, ("h100pcie",)),
    _Datasheet("H200", 67, 495, 989, 989, 4.8, _PCIE5, True, ("h200",)),
    _Datasheet("H20", 44, 74, 148, 148, 4.0, _PCIE5, True, ("h20",)),
    _Datasheet("GH200", 67, 495, 989, 989, 4.0, 450.0, True, ("gh200",)),
    _Datasheet("A100-class GPU (no GPU named)", 19.5, 156, 312, 312, 2.0, _PCIE4, False, ("default",)),
    _Datasheet("A100", 19.5, 156, 312, 312, 2.0, _PCIE4, False, ("a100", "a800")),
    _Datasheet("A10", 31.2, 62.5, 125, 125, 0.6, _PCIE4, False, ("a10", "a10g")),
    _Datasheet("A30", 10.3, 82, 165, 165, 0.93, _PCIE4, False, ("a30",)),
    _Datasheet("A40", 37.4, 74.8, 150, 150, 0.7, _PCIE4, False, ("a40",)),
    _Datasheet("RTX A6000", 38.7, 77, 155, 155, 0.77, _PCIE4, False, ("a6000",)),
    _Datasheet("L4", 30.3, 60, 121, 121, 0.3, _PCIE4, False, ("l4",)),
    _Datasheet("L40", 90.5, 90.5, 181, 181, 0.86, _PCIE4, False, ("l40",)),
    _Datasheet("L40S", 91.6, 183, 362, 362, 0.86, _PCIE4, False, ("l40s",)),
    # V100 and T4 have no bf16 units: torch runs bf16 products there near the fp32 rate.
    _Datasheet("V100", 15.7, 15.7, 15.7, 125, 0.9, _PCIE3, False, ("v100",)),
    _Datasheet("T4", 8.1, 8.1, 8.1, 65, 0.32, _PCIE3, False, ("t4",)),
    _Datasheet("RTX 3090", 35.6, 35.6, 71, 71, 0.94, _PCIE4, False, ("rtx3090",)),
    _Datasheet("RTX 4090", 82.6, 82.6, 165, 165, 1.0, _PCIE4, False, ("rtx4090",)),
)
GPU_TABLE: dict[str, DeviceSpeeds] = {name: sheet.speeds() for sheet in _SHEETS for name in sheet.names}
"""Every GPU name ``gpu=`` accepts (after lower-casing and dropping spaces and dashes)."""
GPU_NAMES = ("auto", *GPU_TABLE)
HOPPER_NAMES = tuple(name for name, speeds in GPU_TABLE.items() if speeds.hopper)

CPU_SPEEDS = DeviceSpeeds(
    "CPU", {"fp32": 0.2e12, "tf32": 0.2e12, "bf16": 0.2e12, "fp16": 0.2e12}, 6.6e9, 10e9, 10e9,
    kernel_s=1e-6, host_op_s=6e-6, source="a generic server CPU",
)  # fmt: skip
"""A step on "cpu": its "host link" is a copy within host memory (model-state offload's copies there).
Its memory figure is what eager CPU kernels sustain (6.25 GB/s, as priced before the GPU's
``MEMORY_EFFICIENCY`` was measured on an H100), not a copy's bandwidth. Its host price stays the
6 us assumed before ``HOST_OP_S`` was measured on a GPU's host: on a CPU the ops run in line with the
host, and no step there has been held against it."""


def parse_gpu(value: Any, *, flag: str) -> str:
    """A name of ``GPU_NAMES`` (``"H100"``, ``"h100-pcie"``, ``"auto"``); ``ValueError`` names ``flag``."""
    key = value.strip().lower().replace(" ", "").replace("-", "") if isinstance(value, str) else None
    if key not in GPU_NAMES:
        raise ValueError(f"{flag}: unknown GPU {value!r}; accepted: {', '.join(GPU_NAMES)}")
    return key


def gpu_key(device_name: str, capability: tuple[int, int] | None = None) -> str:
    """The table name of a CUDA device (``torch.cuda.get_device_name``): ``"NVIDIA H100 80GB HBM3"``
    -> ``"h100"``; a device the table lacks is ``"hopper"`` on compute capability 9.x, else
    ``"default"``."""
    name = device_name.lower().replace(" ", "").replace("-", "").replace("nvidia", "").replace("geforce", "")
    if "h100" in name:
        return "h100pcie" if ("pcie" in name or "nvl" in name) else "h100"
    for key in ("gh200", "h200", "h800", "h20", "a100", "a800", "l40s", "a6000", "rtx4090", "rtx3090"):
        if key in name:
            return key
    for key in ("a10g", "a10", "a30", "a40", "l40", "l4", "v100", "t4"):
        if key in name:
            return key
    if capability is not None and capability[0] == 9:
        return "hopper"
    return "default"


def local_gpu_key() -> str | None:
    """The table name of this machine's current CUDA device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    return gpu_key(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))


def resolve_gpu(key: str) -> str:
    """``"auto"``: this machine's GPU (``local_gpu_key``) or ``"default"``; any other name as it is."""
    if key != "auto":
        return key
    return local_gpu_key() or "default"


def speeds_for(device: str, gpu: str) -> DeviceSpeeds:
    """The table's speeds for a parsed ``gpu`` name on ``device`` ("cuda" or "cpu")."""
    if device != "cuda":
        return CPU_SPEEDS
    return GPU_TABLE[resolve_gpu(gpu)]


# -- measuring the device -------------------------------------------------------------------------


def cuda_seconds(run: Any) -> float:
    """Device seconds of the work ``run()`` queues on the current stream, between two CUDA events
    (the host waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _best_s(run: Any, repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` timings of ``run()`` with CUDA events, after one warm-up."""
    run()
    return min(cuda_seconds(run) for _ in range(repeats))


WARM_CLOCKS_S = 0.05
"""Seconds of products run before the timed ones: an idle GPU clocks down (an H200 read 345 MHz
idle, 1980 MHz under load), and the bf16 rate measured at fit start spread from 522 to 725 TFLOP/s
over the runs of 2026-11-27 (docs/gpu-runs) with one untimed product before three timed ones."""


def _warm_clocks(device: torch.device, size: int, seconds: float = WARM_CLOCKS_S) -> None:
    """Keep the GPU busy with products for ``seconds`` (host clock, synchronising each round)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(4):
            a @ a
        torch.cuda.synchronize(device)
    del a


def measure_device_speeds(
    device: torch.device | str, *, copy_bytes: int = 256 << 20, matmul_size: int = 4096, repeats: int = 3
) -> DeviceSpeeds:
    """The training device's own rates, measured now (about 0.15-0.35 s on a recent GPU, 50 ms of it
    keeping the clocks up before the timed products).

    A page-locked copy of ``copy_bytes`` each way, a device-to-device copy of twice that, and a
    ``matmul_size``-cubed product in each of fp32, tf32 (when torch allows TF32 for products),
    bf16 and fp16; the fastest of ``repeats`` each. What is not measured (the kernel floor, the
    host's launch time) is taken from the table entry of the device's name.

    Raises:
        ValueError: ``device`` is not a CUDA device of this machine.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"measure_device_speeds(device=...): needs a CUDA device; got {str(device)!r}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    name = torch.cuda.get_device_name(index)
    table = GPU_TABLE[gpu_key(name, torch.cuda.get_device_capability(index))]
    started = time.perf_counter()
    with torch.cuda.device(index):
        host = torch.empty(copy_bytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        on_device = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        to_device_s = _best_s(lambda: on_device.copy_(host, non_blocking=True), repeats, device)
        to_host_s = _best_s(lambda: host.copy_(on_device, non_blocking=True), repeats, device)
        other = torch.empty_like(on_device)
        memory_s = _best_s(lambda: other.copy_(on_device), repeats, device)
        del host, on_device, other
        rates: dict[str, float] = {}
        flops = 2.0 * matmul_size**3
        _warm_clocks(device, matmul_size)
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            a = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
            b = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
            if dtype is torch.float32:
                allowed = torch.backends.cuda.matmul.allow_tf32
                try:  # fp32 as torch runs it by default, then TF32
                    torch.backends.cuda.matmul.allow_tf32 = False
                    rates["fp32"] = flops / _best_s(lambda: a @ b, repeats, device)
                    torch.backends.cuda.matmul.allow_tf32 = True
                    rates["tf32"] = flops / _best_s(lambda: a @ b, repeats, device)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = allowed
            else:
                rates[dtype_name] = flops / _best_s(lambda: a @ b, repeats, device)
            del a, b
        torch.cuda.empty_cache()
    took = time.perf_counter() - started
    return DeviceSpeeds(
        table.name if table.name != GPU_TABLE["default"].name else name, rates, 2 * copy_bytes / memory_s,
        copy_bytes / to_host_s, copy_bytes / to_device_s, kernel_s=table.kernel_s, host_op_s=table.host_op_s,
        source=f"measured on cuda:{index} ({name}) in {took:.2f} s", hopper=table.hopper,
    )  # fmt: skip


# -- pricing one op of a traced step ------------------------------------------------------------

_ATTENTION_WORDS = ("attention",)
_CONVOLUTION_WORDS = ("convolution", "conv2d", "conv3d", "conv1d")
_FREE_FACTORIES = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh")
_DTYPE_NAMES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
}  # fmt: skip


@dataclass(frozen=True)
class _OpInfo:
    """What pricing needs to know of an op, once per op: its class, whether it is free (a view, an
    allocation), and which arguments it writes in place (read and written: counted twice)."""

    kind: str
    free: bool
    written: tuple[int, ...]
    memory_kind: str = MEMORY
    """Its class when it does no matrix work: ``REDUCTION`` for ``_REDUCTIONS``, else ``MEMORY``."""
    overwrites: bool = False
    """Its written argument is overwritten, not read (``_OVERWRITES``)."""
    gather: Any = None
    """Its bytes as ``gather(args, produced)`` (``_GATHERS``), or None: its arguments' bytes."""


_OP_INFO: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        packet = func._overloadpacket.__name__
        if any(word in packet for word in _ATTENTION_WORDS):
            kind = ATTENTION
        elif any(word in packet for word in _CONVOLUTION_WORDS):
            kind = CONVOLUTION
        else:
            kind = MATMUL
        free = bool(getattr(func, "is_view", False)) or packet in _FREE_FACTORIES
        written = tuple(
            index for index, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write and not argument.kwarg_only
        )  # fmt: skip
        info = _OP_INFO[func] = _OpInfo(
            kind, free, written, REDUCTION if packet in _REDUCTIONS else MEMORY, packet in _OVERWRITES,
            _GATHERS.get(packet),
        )  # fmt: skip
    return info


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def op_cost(func: Any, args: Any, kwargs: Any, out: Any, flops: float) -> tuple[str, str, float, int] | None:
    """``(class, dtype name, flops, bytes)`` of one traced op, or None for a free one (a view, an
    allocation). ``flops`` is torch's FLOP count of the op (0: not a matrix op); bytes are those it
    reads and writes. fp32 products are named "tf32" where torch lets them use TF32."""
    info = _op_info(func)
    if info.free:
        return None
    written = 0
    for index in info.written:
        if index < len(args):
            written += _tensor_bytes(args[index])
    produced = _tensor_bytes(out)
    if not produced and not written:  # a query (a tensor's device, size, a profiler mark): no kernel
        return None
    if info.gather is not None:
        return MEMORY, "", 0.0, info.gather(args, produced)
    read = _tensor_bytes(args) + _tensor_bytes(list(kwargs.values()))
    if info.overwrites:
        read -= written
    # An op that writes in place returns what it wrote: its output is not a second write.
    nbytes = read + (written if info.written else produced)
    if not flops:
        return info.memory_kind, "", 0.0, nbytes
    first = next((value for value in args if isinstance(value, torch.Tensor)), None)
    dtype_name = _DTYPE_NAMES.get(first.dtype, "fp32") if first is not None else "fp32"
    kind = info.kind
    if kind == MATMUL and first is not None and _misaligned(args, first.element_size()):
        kind = MISALIGNED
    if dtype_name == "fp32":
        tf32 = (
            torch.backends.cudnn.allow_tf32 if kind == CONVOLUTION
            else kind in (MATMUL, MISALIGNED) and torch.backends.cuda.matmul.allow_tf32
        )  # fmt: skip
        if tf32:
            dtype_name = "tf32"
    return kind, dtype_name, flops, nbytes


_OVERWRITES = frozenset(("copy_", "fill_", "zero_"))
"""In-place ops whose written argument is overwritten, not read."""
_REDUCTIONS = frozenset((
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "cudnn_batch_norm", "cudnn_batch_norm_backward",
    "batch_norm_backward", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
    "sum", "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
))  # fmt: skip
"""Memory-bound ops priced at ``REDUCTION_EFFICIENCY`` (see ``REDUCTION``)."""


def _nll_forward_bytes(args: Any, produced: int) -> int:
    # Reads one log-probability per target (the target and weight, not the whole input).
    target = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
    if target is None:
        return produced
    return _tensor_bytes(target) + target.numel() * args[0].element_size() + produced


def _nll_backward_bytes(args: Any, produced: int) -> int:
    # Writes the whole input gradient (zeros, and one value per target): reads only the targets.
    return produced + (_tensor_bytes(args[2]) if len(args) > 2 else 0)


_GATHERS = {
    "nll_loss_forward": _nll_forward_bytes, "nll_loss2d_forward": _nll_forward_bytes,
    "nll_loss_backward": _nll_backward_bytes, "nll_loss2d_backward": _nll_backward_bytes,
}  # fmt: skip
"""Ops that touch a few elements per row (the loss's gather and its scatter): their bytes, not
their arguments' (the H100 profile: 0.02 ms where the whole logits' bytes priced 0.57 ms)."""


def _misaligned(args: Any, itemsize: int) -> bool:
    """Whether a product's matrices have a dimension the tensor cores cannot tile: not a multiple of
    16 bytes' worth of elements (8 in bf16, 4 in fp32)."""
    multiple = max(1, 16 // itemsize)
    return any(
        value.dim() >= 2 and (value.shape[-1] % multiple or value.shape[-2] % multiple)
        for value in args
        if isinstance(value, torch.Tensor)
    )
