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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

_workspace_cache: dict[tuple[Any, ...], int] = {}

# Probe exactly up to these sizes; beyond, extrapolate from probes at most this large.
_EXACT_BATCH, _EXACT_STEPS = 32, 64


def _probe(args: tuple[Any, ...], batch: int, steps: int, time_major: bool) -> int:
    inp, w0, w1, w2, w3, hx, cx = args[:7]
    shape = (steps, batch, inp.shape[2]) if time_major else (batch, steps, inp.shape[2])
    with unset_fake_temporarily(), torch.enable_grad():
        real = [torch.zeros(shape, dtype=inp.dtype)]
        real += [torch.zeros(tuple(w.shape), dtype=w.dtype) for w in (w0, w1, w2, w3)]
        real += [
            torch.zeros((batch, *hx.shape[1:]), dtype=hx.dtype),
            torch.zeros((batch, *cx.shape[1:]), dtype=cx.dtype),
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
    workspace = torch.empty(size, dtype=torch.uint8)
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
