"""How a CUDA step's ops allocate differently from the CPU step the estimator actually traces.

A CPU-only build of torch cannot run autograd on fake CUDA tensors, so the estimator traces fake
CPU tensors and corrects, above autograd (a ``TorchFunctionMode``), the places where CUDA would
allocate differently:

- autocast policy: CUDA runs layer_norm, group_norm, softmax, log_softmax, exp, log, pow, the
  losses and a few more in float32 where CPU autocast keeps the low-precision dtype, casts a few
  more matmul-like ops (addmv, addr, mv, rnn cells) down, and keeps 3-D pooling and padding in the
  low-precision dtype where CPU autocast casts them up (lists from ATen's autocast_mode.h);
- dropout: CUDA's fused kernel saves a 1-byte mask, the CPU path a full-size float noise tensor;
- attention with dropout: CUDA's flash / memory-efficient kernels draw the dropout inside the
  kernel and keep only the output and log-sum-exp, where CPU falls back to the math path that
  keeps the score matrix; the trace runs CPU's flash kernel without dropout, which keeps the same;
- cross-entropy: CUDA computes log_softmax straight into float32; CPU autocast first copies the
  logits to float32.

What the CUDA caching allocator counts that the CPU trace cannot see is in ``cuda_memory``; the
remaining differences (optimizer foreach default, host-side step counters) are handled by the
step driver and the tracer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map


def _functions(names: tuple[str, ...]) -> set[Any]:
    found = set()
    for name in names:
        for namespace in (torch, torch.Tensor, F, torch.special, torch.linalg):
            function = getattr(namespace, name, None)
            if function is not None:
                found.add(function)
    return found


_LOW = (torch.float16, torch.bfloat16)

# CUDA's fp32 policy (inputs cast to float32) for ops CPU autocast leaves alone.
_FP32_NAMES = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "group_norm", "cosine_similarity",
    "dist", "pdist", "renorm", "logsumexp", "interpolate", "upsample", "upsample_nearest",
    "upsample_bilinear", "__pow__", "__rpow__", "__ipow__",
)  # fmt: skip
# CUDA's fp32_set_opt_dtype policy: computed and returned in float32 (no input copy).
_OPT_DTYPE_NAMES = ("softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum")
# CUDA's lower-precision policy for ops CPU autocast does not cast.
_LOWER_NAMES = (
    "addmv",
    "addr",
    "mv",
    "chain_matmul",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
)
# CPU autocast casts these to float32; CUDA autocast leaves them in the input dtype.
_KEEP_NAMES = (
    "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "max_unpool2d", "max_unpool3d", "polar",
    "quantile", "nanquantile", "stft", "trace",
)  # fmt: skip


_FP32 = _functions(_FP32_NAMES)
_OPT_DTYPE = _functions(_OPT_DTYPE_NAMES)
_LOWER = _functions(_LOWER_NAMES)
_KEEP = _functions(_KEEP_NAMES)
_DROPOUT = {F.dropout, torch.dropout, torch.Tensor.dropout if hasattr(torch.Tensor, "dropout") else F.dropout}


def _cast(value: Any, dtype: torch.dtype, sources: tuple[torch.dtype, ...]) -> Any:
    def cast(item: Any) -> Any:
        if isinstance(item, torch.Tensor) and item.is_floating_point() and item.dtype in sources:
            return item.to(dtype)
        return item

    return tree_map(cast, value)


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
    return None


class CudaBehaviour(TorchFunctionMode):
    """Makes a fake CPU step allocate as the same step would on CUDA (see the module docstring)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUT:
            return _fused_dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return _fused_attention(args, kwargs)
        if not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        low = torch.get_autocast_dtype("cpu")
        if func is F.cross_entropy:
            return _cross_entropy(args, kwargs)
        if func in _FP32:
            args, kwargs = _cast((args, kwargs), torch.float32, _LOW)
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        if func in _OPT_DTYPE:
            first = _first_tensor(args)
            if first is not None and first.dtype in _LOW and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        if func in _LOWER:
            args, kwargs = _cast((args, kwargs), low, (torch.float32,))
            return func(*args, **kwargs)
        if func in _KEEP:
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _fused_dropout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x = bound["input"]
    p = bound.get("p", 0.5)
    training = bound.get("training", bound.get("train", True))
    if training and 0.0 < p < 1.0 and x.is_floating_point():
        # CUDA's fused kernel: native_dropout saves a bool mask.
        out, _mask = torch.native_dropout(x, p, True)
        if bound.get("inplace", False):
            return x.copy_(out)
        return out
    return func(*args, **kwargs)


def _fused_attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    if bound.get("dropout_p", 0.0):
        bound["dropout_p"] = 0.0
    return F.scaled_dot_product_attention(**bound)


def _cross_entropy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = (
        "input",
        "target",
        "weight",
        "size_average",
        "ignore_index",
        "reduce",
        "reduction",
        "label_smoothing",
    )
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, target = bound["input"], bound["target"]
    smoothing = bound.get("label_smoothing", 0.0)
    if (
        x.dtype not in _LOW
        or target.is_floating_point()
        or smoothing
        or bound.get("size_average") is not None
        or bound.get("reduce") is not None
    ):
        return F.cross_entropy(*args, **kwargs)
    with torch.autocast("cpu", enabled=False):
        log_probs = torch.log_softmax(x, dim=1 if x.dim() > 1 else 0, dtype=torch.float32)
        return F.nll_loss(
            log_probs, target, weight=bound.get("weight"),
            ignore_index=bound.get("ignore_index", -100), reduction=bound.get("reduction", "mean"),
        )  # fmt: skip
