"""Kernels whose fake (meta) version allocates differently from the real one, and the fix for each.

oneDNN's RNN layer (``aten.mkldnn_rnn_layer``, what ``nn.LSTM`` runs on CPU) returns a workspace
that backward needs; its meta kernel returns an empty one, although the real workspace is often
the largest saved tensor of the model. Its size is oneDNN's business (page-aligned gates, states
and cell states), so it is measured: the real kernel runs on small zero tensors of the same
layer sizes and the size is extrapolated (linear in batch and in sequence length; within 0.2% in
our checks). CUDA runs cuDNN instead, whose reserve space is not modelled; the oneDNN size stands
in for it there.

Batch norm on a bfloat16/float16 input with float32 parameters or running statistics (autocast's
mixed precision) keeps its saved mean and inverse std in float32; the meta kernel gives them the
input's dtype.

Some fake kernels are stricter than the real ones: torch 2.13's ``aten._grouped_mm`` (what Hugging
Face's mixture-of-experts layers run by default) accepts only bfloat16 on fake tensors, while the
real CPU kernel takes float32. ``STAND_INS`` computes such an op's output itself when its fake
kernel refuses inputs the real kernel takes. Any other op whose fake kernel refuses is run for
real on zero tensors of the same shapes, when they are small (``real_output``): its output then
stands in, and when the real kernel refuses too, the estimate can say that a real step fails.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map

from lightmem.config import format_bytes

_workspace_cache: dict[tuple[Any, ...], int] = {}

# Probe exactly up to these sizes; beyond, extrapolate from probes at most this large.
_EXACT_BATCH, _EXACT_STEPS = 32, 64


def _probe(args: tuple[Any, ...], batch: int, steps: int, time_major: bool) -> int:
    inp, w0, w1, w2, w3, hx, cx = args[:7]
    shape = (steps, batch, inp.shape[2]) if time_major else (batch, steps, inp.shape[2])
    with unset_fake_temporarily(), torch.enable_grad():
        real = [torch.zeros(shape, dtype=inp.dtype, device="cpu")]  # oneDNN's kernel, run for real on the CPU
        real += [torch.zeros(tuple(w.shape), dtype=w.dtype, device="cpu") for w in (w0, w1, w2, w3)]
        real += [
            torch.zeros((batch, *hx.shape[1:]), dtype=hx.dtype, device="cpu"),
            torch.zeros((batch, *cx.shape[1:]), dtype=cx.dtype, device="cpu"),
        ]
        out = torch.ops.aten.mkldnn_rnn_layer.default(*real, *args[7:])
        return int(out[3].numel() * out[3].element_size())


def mkldnn_workspace_bytes(args: tuple[Any, ...]) -> int:
    """Bytes of the workspace the real ``mkldnn_rnn_layer`` returns for these arguments."""
    inp, hx = args[0], args[5]
    batch = int(hx.shape[0])
    time_major = int(inp.shape[1]) == batch
    steps = int(inp.shape[0] if time_major else inp.shape[1])
    key = (
        tuple(inp.shape), inp.dtype, tuple(tuple(a.shape) for a in args[1:7]), time_major,
        tuple(tuple(a) if isinstance(a, list) else (None if isinstance(a, torch.Tensor) else a) for a in args[7:]),
    )  # fmt: skip
    if key in _workspace_cache:
        return _workspace_cache[key]
    if batch <= _EXACT_BATCH and steps <= _EXACT_STEPS:
        size = _probe(args, batch, steps, time_major)
    else:
        b1, b2 = min(batch, _EXACT_BATCH // 4), min(batch, _EXACT_BATCH // 2)
        t1, t2 = min(steps, _EXACT_STEPS // 4), min(steps, _EXACT_STEPS // 2)
        probes = {(b, t): _probe(args, b, t, time_major) for b in {b1, b2} for t in {t1, t2}}

        def at_steps(t: int) -> float:
            slope = (probes[(b2, t)] - probes[(b1, t)]) / (b2 - b1) if b2 != b1 else 0.0
            return probes[(b1, t)] + (batch - b1) * slope

        slope_t = (at_steps(t2) - at_steps(t1)) / (t2 - t1) if t2 != t1 else 0.0
        size = round(at_steps(t1) + (steps - t1) * slope_t)
    _workspace_cache[key] = size
    return size


def _fix_mkldnn_rnn_layer(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    try:
        size = mkldnn_workspace_bytes(args)
    except RuntimeError:  # oneDNN may reject a dtype on this CPU: keep the meta kernel's answer
        return out
    workspace = torch.empty(size, dtype=torch.uint8, device=out[0].device)  # beside the op's outputs
    return (out[0], out[1], out[2], workspace)


def _fix_native_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    inp = args[0]
    if inp.dtype not in (torch.bfloat16, torch.float16):
        return out
    params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    if not any(p.dtype == torch.float32 for p in params):
        return out
    mean, invstd = out[1], out[2]
    return (out[0], mean.to(torch.float32), invstd.to(torch.float32))


CORRECTIONS: dict[Any, Callable[[tuple[Any, ...], dict[str, Any], Any], Any]] = {
    torch.ops.aten.mkldnn_rnn_layer.default: _fix_mkldnn_rnn_layer,
    torch.ops.aten.native_batch_norm.default: _fix_native_batch_norm,
}


def _grouped_mm_output(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The output of ``aten._grouped_mm`` as the real kernels shape it (row-major), or None when
    the shapes do not fit (then the fake kernel's refusal stands)."""
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args), **kwargs)
    mat_a, mat_b, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
    if bound.get("bias") is not None or mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
        return None
    if mat_a.dim() == 3 and mat_b.dim() == 3:  # a batch of matmuls
        if offs is not None or mat_a.shape[0] != mat_b.shape[0] or mat_a.shape[2] != mat_b.shape[1]:
            return None
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[2])
    elif offs is None or offs.dim() != 1:
        return None
    elif mat_a.dim() == 2 and mat_b.dim() == 2:  # groups along the contraction: one output per group
        if mat_a.shape[1] != mat_b.shape[0]:
            return None
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif mat_a.dim() == 2:  # groups of rows of mat_a, one matrix of mat_b each
        if mat_a.shape[1] != mat_b.shape[1] or offs.shape[0] != mat_b.shape[0]:
            return None
        shape = (mat_a.shape[0], mat_b.shape[2])
    else:
        if mat_a.shape[2] != mat_b.shape[0] or offs.shape[0] != mat_a.shape[0]:
            return None
        shape = (mat_a.shape[1], mat_b.shape[1])
    return torch.empty(shape, dtype=bound.get("out_dtype") or mat_a.dtype, device=mat_a.device)


STAND_INS: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    torch.ops.aten._grouped_mm.default: _grouped_mm_output,
}

REAL_RUN_LIMIT_BYTES = 64 * 2**20
"""The most input bytes ``real_output`` runs an op on for real (zero tensors, host memory)."""


class RealKernel(enum.Enum):
    """What is known about the real kernel of an op whose fake kernel refused its inputs."""

    ACCEPTS = "accepts"
    REFUSES = "refuses"
    NOT_RUN = "not run"


def real_output(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[RealKernel, Any, str]:
    """The output of ``func`` when its fake kernel refused ``args``: (verdict, output, why not run).

    A stand-in computes it for the ops listed in ``STAND_INS``. Otherwise the real kernel runs on
    zero tensors of the same shapes, strides and dtypes, when they are at most
    ``REAL_RUN_LIMIT_BYTES`` on the CPU and the op neither draws random numbers (the user's RNG
    stays as it was), writes its arguments nor returns a view of them; its output's shape, strides
    and dtype stand in for the fake one's.
    """
    stand_in = STAND_INS.get(func)
    if stand_in is not None:
        output = stand_in(args, kwargs)
        if output is not None:
            return RealKernel.ACCEPTS, output, ""
    schema = func._schema
    if schema.is_mutable or any(ret.alias_info is not None for ret in schema.returns):
        return RealKernel.NOT_RUN, None, "it writes its arguments or returns a view of them"
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return RealKernel.NOT_RUN, None, "it draws random numbers"
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    if any(tensor.device.type != "cpu" for tensor in tensors):
        return RealKernel.NOT_RUN, None, "its inputs are not on the CPU"
    input_bytes = sum(tensor.untyped_storage().nbytes() for tensor in tensors)
    if input_bytes > REAL_RUN_LIMIT_BYTES:
        return RealKernel.NOT_RUN, None, (
            f"its inputs take {format_bytes(input_bytes)}, more than the {format_bytes(REAL_RUN_LIMIT_BYTES)} "
            "lightmem runs an op on for real"
        )

    def real(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        zeros = torch.zeros(leaf.untyped_storage().nbytes(), dtype=torch.uint8, device="cpu")
        return zeros.view(leaf.dtype).as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())

    with unset_fake_temporarily(), torch.no_grad():
        try:
            output = func(*tree_map(real, args), **tree_map(real, kwargs))
        except Exception:  # noqa: BLE001 - any refusal of the real kernel is the answer
            return RealKernel.REFUSES, None, ""
        shapes = tree_map(
            lambda t: (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t, output
        )
    return RealKernel.ACCEPTS, tree_map(
        # on the CPU, as the inputs are (checked above)
        lambda m: torch.empty_strided(m[0], m[1], dtype=m[2], device="cpu") if _is_meta_triple(m) else m, shapes,
        is_leaf=_is_meta_triple,
    ), ""


def _is_meta_triple(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], torch.dtype)
