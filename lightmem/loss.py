"""``linear_cross_entropy``: a language model's loss without its full logits.

``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` makes logits of shape (rows,
classes), a float32 copy, their log-softmax and, in backward, gradients of the same size: with a
large vocabulary these are the step's peak, and neither checkpointing nor offload reaches them.
``linear_cross_entropy`` computes the same loss and gradients over row chunks: each chunk's logits
are made, turned into its loss and its gradient with respect to the logits, multiplied back into
the gradients of ``hidden``, ``weight`` and ``bias``, and freed before the next chunk. So no tensor
of more than ``chunk_rows`` rows of logits ever exists.

How: the gradients are computed in forward (as Liger Kernel's fused linear cross-entropy and
torch's chunked ``F.linear_cross_entropy`` do), so the step runs the three products of the
unchunked loss (logits, their gradient times the weight, times the hidden states) and no more.
Recomputing each chunk's logits in backward instead would add a fourth product (a third more of
the head's work, about 5% of a 16-block GPT's step). What forward keeps for backward: the gradient
of ``hidden`` (its shape, in the dtype the products run in), of ``weight`` (float32) and of
``bias`` (float32); backward only scales them by the loss's gradient. The kept gradients are
unscaled sums (before the mean's division and the loss's gradient), so fp16 products never see
the tiny per-element gradients of a mean over many rows that would flush to zero.
``reduction="none"`` cannot be scaled after the fact (each row has its own gradient): it keeps
only its inputs and recomputes the chunks in backward (four products).

Dtypes follow the unchunked reference: under autocast the products run in autocast's dtype (as
``F.linear`` does), everything after them in float32 (as ``.float()`` does), the loss is float32.

What is not bitwise equal to the reference, and why: the weight's and the bias's gradients are
summed chunk by chunk (each chunk's product rounded to the products' dtype, then added in float32),
where the reference sums all rows in one product; the loss is summed row by row with the label
smoothing term added per row, where the reference sums the two terms apart; the gradient of the
logits is computed as (exp(z - max) - terms * sum / a) * a / sum (the target's and smoothing's terms
taken off before the row's factor a is applied, so that it is written in the products' dtype in one
pass), where torch's log-softmax backward computes softmax * a - terms. Within a chunk the logits
are the same product as the reference's. The tests' bounds: docs/chunked-loss.md.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from lightmem.config import parse_count

REDUCTIONS = ("mean", "sum", "none")
CHUNK_FLOOR_BYTES = 256 * 2**20
"""The default chunk is never smaller than this many bytes of float32 logits (2048 rows at a 32k
vocabulary, 256 at 256k): a chunk's products then keep a GPU busy longer than the host takes to
launch its dozen kernels, and its share of the step's memory stays small beside the whole logits."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The loss of ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` without
    materialising the logits.

    Args:
        hidden: the hidden states the output head reads, shape ``(..., in_features)``.
        weight: the head's weight, shape ``(classes, in_features)`` (``lm_head.weight``).
        target: class indices, one per row: shape ``hidden.shape[:-1]``, or those rows flattened
            (an integer tensor).
        bias: the head's bias, shape ``(classes,)``, or None.
        ignore_index: targets equal to it add nothing to the loss nor to the gradients.
        reduction: ``"mean"`` (over the targets not ignored, weighted by ``class_weight``),
            ``"sum"`` or ``"none"`` (one loss per target, shape ``target.shape``).
        label_smoothing: in [0, 1], as for ``F.cross_entropy``.
        class_weight: a weight per class, shape ``(classes,)`` (``F.cross_entropy``'s ``weight``).
        chunk_rows: rows of logits made at a time; None: enough rows that a chunk's float32
            logits take about half the hidden states' float32 size, and at least 256 MiB
            (``default_chunk_rows``).
        softcap: a positive ``c``: the loss reads ``torch.tanh(logits / c) * c`` (Gemma-2's
            ``final_logit_softcapping``), applied to each chunk's logits in the products' dtype,
            as the model applies it to the head's output; None: the logits as they are.

    Returns:
        The loss in float32 (float64 for float64 inputs): a scalar, or ``target``'s shape with
        ``reduction="none"``.

    Raises:
        ValueError: a bad argument (named in the message).

    The gradients of ``reduction="mean"`` and ``"sum"`` are computed in forward and used up by
    the first backward: a second backward through the same loss (``retain_graph=True``) raises.
    Under ``torch.compile`` the function runs eagerly (the compiler does not trace it).

    Example::

        >>> import torch
        >>> import lightmem
        >>> hidden = torch.randn(4, 16, 32, requires_grad=True)
        >>> head = torch.nn.Linear(32, 1000, bias=False)
        >>> target = torch.randint(0, 1000, (4, 16))
        >>> loss = lightmem.linear_cross_entropy(hidden, head.weight, target, chunk_rows=16)
        >>> reference = torch.nn.functional.cross_entropy(head(hidden).float().flatten(0, 1), target.flatten())
        >>> torch.allclose(loss, reference)
        True
    """
    return _linear_cross_entropy(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, class_weight, chunk_rows, softcap
    )


@torch.compiler.disable
def _linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    class_weight: torch.Tensor | None,
    chunk_rows: int | None,
    softcap: float | None,
) -> torch.Tensor:
    _check(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, class_weight, chunk_rows, softcap)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # What autocast does to F.linear: every floating input in autocast's dtype (float64 stays).
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = (t.to(dtype) if t.dtype != torch.float64 else t for t in (hidden, weight))
        if bias is not None and bias.dtype != torch.float64:
            bias = bias.to(dtype)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(
            f"linear_cross_entropy: hidden ({hidden.dtype}), weight ({weight.dtype})"
            + (f" and bias ({bias.dtype})" if bias is not None else "")
            + " must have one dtype, as for F.linear (or run under autocast)"
        )
    in_features = hidden.shape[-1]
    rows = hidden.numel() // in_features if in_features else 0
    chunk = chunk_rows if chunk_rows is not None else default_chunk_rows(rows, in_features, weight.shape[0])
    wants = (
        torch.is_grad_enabled() and hidden.requires_grad,
        torch.is_grad_enabled() and weight.requires_grad,
        torch.is_grad_enabled() and bias is not None and bias.requires_grad,
    )
    loss = _LinearCrossEntropy.apply(
        hidden.reshape(rows, in_features), weight, bias, target.reshape(rows), class_weight,
        ignore_index, reduction, float(label_smoothing), chunk, wants, None if softcap is None else float(softcap),
    )  # fmt: skip
    return loss.reshape(target.shape) if reduction == "none" else loss


def default_chunk_rows(rows: int, in_features: int, classes: int) -> int:
    """Rows per chunk when none is given: a power of two whose float32 logits take about half
    the float32 size of the hidden states (torch's ``chunking_method="aspect_ratio:2"``), and at
    least ``CHUNK_FLOOR_BYTES`` of them; never more than ``rows`` (at least 1)."""
    if rows <= 0 or classes <= 0:
        return 1
    per_hidden = math.ceil(classes / max(in_features, 1))
    aspect = 1 << max(math.ceil(rows / per_hidden) - 1, 0).bit_length()
    floor = 1 << max(CHUNK_FLOOR_BYTES // (classes * 4), 1).bit_length() - 1
    return max(1, min(rows, max(aspect // 2, floor)))


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    class_weight: torch.Tensor | None,
    chunk_rows: int | None,
    softcap: float | None,
) -> None:
    name = "linear_cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}(reduction=...): expected one of {', '.join(map(repr, REDUCTIONS))}; got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}(label_smoothing=...): expected a number in [0, 1]; got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"{name}(ignore_index=...): expected an int; got {ignore_index!r}")
    parse_count(chunk_rows, flag=f"{name}(chunk_rows=...)", allow_none=True)
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"{name}(softcap=...): expected a positive number or None; got {softcap!r}")
    if weight.dim() != 2:
        raise ValueError(f"{name}(weight=...): expected shape (classes, in_features); got {list(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: hidden's last dimension must be weight's in_features ({weight.shape[1]}); "
            f"got hidden of shape {list(hidden.shape)}"
        )
    if target.numel() != hidden.numel() // max(hidden.shape[-1], 1):
        raise ValueError(
            f"{name}(target=...): expected one class index per row of hidden, {list(hidden.shape[:-1])} (hidden's "
            f"shape without its last dimension, or flattened); got {list(target.shape)}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"{name}(target=...): expected class indices (an integer tensor); got {target.dtype}")
    classes = weight.shape[0]
    for label, tensor in (("bias", bias), ("class_weight", class_weight)):
        if tensor is not None and tuple(tensor.shape) != (classes,):
            raise ValueError(f"{name}({label}=...): expected shape ({classes},); got {list(tensor.shape)}")


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked forward (loss, and for scalar reductions every gradient); backward scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        class_weight: torch.Tensor | None,
        ignore_index: int,
        reduction: str,
        smoothing: float,
        chunk: int,
        wants: tuple[bool, bool, bool],
        softcap: float | None,
    ) -> torch.Tensor:
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            rows = _Rows(hidden, weight, bias, target, class_weight, ignore_index, smoothing, softcap)
            if reduction == "none":
                ctx.save_for_backward(hidden, weight, bias, target, class_weight)
                ctx.recompute = (ignore_index, smoothing, chunk, wants, softcap)
                return rows.run(chunk, loss=True, scale=None, wants=(False, False, False))[0]
            losses, grads = rows.run(chunk, loss=True, scale=None, wants=wants)
            ctx.recompute = None
            ctx.grads = grads
            ctx.denominator = rows.weight_sum() if reduction == "mean" else None
            total = losses.sum()
            return total / ctx.denominator if ctx.denominator is not None else total

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.recompute is not None:  # reduction="none": the chunks again, each row scaled by its gradient
            hidden, weight, bias, target, class_weight = ctx.saved_tensors
            ignore_index, smoothing, chunk, wants, softcap = ctx.recompute
            with torch.autocast(hidden.device.type, enabled=False):
                rows = _Rows(hidden, weight, bias, target, class_weight, ignore_index, smoothing, softcap)
                grads = rows.run(chunk, loss=False, scale=grad_loss.reshape(-1), wants=wants)[1]
            scale = None
        else:
            grads = ctx.grads
            if grads is None:
                raise RuntimeError(
                    "linear_cross_entropy: backward ran twice through one loss (retain_graph=True): its gradients "
                    "were computed in forward and the first backward used them up. Compute the loss again instead."
                )
            ctx.grads = None
            scale = grad_loss
            if ctx.denominator is not None:  # a mean over no target has gradient 0, as the reference's
                scale = torch.where(ctx.denominator != 0, grad_loss / ctx.denominator, 0.0)
        grad_hidden, grad_weight, grad_bias = grads
        for grad in grads:
            if grad is not None and scale is not None:
                grad.mul_(scale)
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight_dtype),
            None if grad_bias is None else grad_bias.to(bias_dtype),
            *(None,) * 8,
        )


class _Rows:
    """The rows of one loss: what every chunk reads, and the loop over chunks."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        class_weight: torch.Tensor | None,
        ignore_index: int,
        smoothing: float,
        softcap: float | None = None,
    ) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.softcap = softcap
        self.accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        self.classes = weight.shape[0]
        self.smoothing = smoothing
        self.valid = target != ignore_index
        self.target = target.masked_fill(~self.valid, 0)
        self.class_weight = None if class_weight is None else class_weight.to(self.accumulate)
        if self.class_weight is None:
            self.target_weight = self.valid.to(self.accumulate)
        else:
            self.target_weight = self.class_weight[self.target] * self.valid

    def weight_sum(self) -> torch.Tensor:
        """The mean's denominator: the class weights of the targets not ignored (their count)."""
        return self.target_weight.sum()

    def run(
        self, chunk: int, *, loss: bool, scale: torch.Tensor | None, wants: tuple[bool, bool, bool]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Every chunk: the loss of each row (``loss``) and the gradients asked for by ``wants``
        (hidden, weight, bias), each row's gradient multiplied by ``scale`` (None: by 1).

        A row's loss, with smoothing s, C classes, class weights w (all 1 without) and z the
        logits less their maximum: (1 - s) w_t (log sum exp z - z_t) + (s / C) sum_c w_c (log
        sum exp z - z_c); its gradient with respect to the logits: a softmax(z) - (1 - s) w_t
        onehot(t) - (s / C) w, where a = (1 - s) w_t + (s / C) sum w. Ignored rows: 0.

        Per chunk, few passes over its logits (each op is a kernel launch, each pass memory
        traffic): the product; its maximum; z in float32; exp in place; the rows' sums; the
        target's and the smoothing's terms, divided by the row's factor, taken off in place; the
        product by the factor, written straight into the logits' buffer in their dtype; the two
        products of the gradients. Row-sized work is done once for every row, outside the loop."""
        hidden, weight, bias = self.hidden, self.weight, self.bias
        rows, accumulate, smoothing, classes = hidden.shape[0], self.accumulate, self.smoothing, self.classes
        want_hidden, want_weight, want_bias = wants
        device = hidden.device
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=device) if want_weight else None
        grad_bias = torch.zeros(classes, dtype=accumulate, device=device) if want_bias and bias is not None else None
        grads_wanted = grad_hidden is not None or grad_weight is not None or grad_bias is not None
        uniform = None
        if smoothing:
            uniform = self.class_weight if self.class_weight is not None else torch.ones(classes, dtype=accumulate, device=device)
        sums = torch.empty(rows, dtype=accumulate, device=device)
        picked = torch.empty(rows, 1, dtype=accumulate, device=device) if loss else None
        weighted = torch.empty(rows, dtype=accumulate, device=device) if loss and smoothing else None
        target_over = spread_over = None  # the target's and smoothing's terms over a (None: 1, none)
        if grads_wanted and not smoothing and scale is None:
            factor = self.target_weight  # a = w_t; a row whose a is 0 has gradient 0 whatever is taken off
        elif grads_wanted:
            # The factor a of each row's softmax, and the target's and smoothing's terms over it
            # (0 for a row whose factor is 0: an ignored row, or a zero gradient from above).
            picked_share = (1 - smoothing) * self.target_weight
            spread = self.valid * (smoothing / classes) if smoothing else None
            factor = picked_share if spread is None else picked_share + spread * uniform.sum()  # type: ignore[union-attr]
            if scale is not None:
                factor = factor * scale.to(accumulate)
            nonzero = factor != 0
            safe = torch.where(nonzero, factor, 1.0)
            target_over = torch.where(nonzero, picked_share * (scale if scale is not None else 1.0) / safe, 0.0)
            if spread is not None:
                spread_over = torch.where(nonzero, spread * (scale if scale is not None else 1.0) / safe, 0.0)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            part = hidden[start:end]
            logits = part @ weight.t() if bias is None else torch.addmm(bias, part, weight.t())
            capped = None
            if self.softcap is not None:  # the model's ops, in the products' dtype: tanh(z / c) * c
                capped = logits.div_(self.softcap).tanh_()  # kept for the gradient through the cap
                logits = capped * self.softcap
            maximum = logits.amax(dim=1, keepdim=True)
            if logits.dtype == accumulate:
                shifted = logits.sub_(maximum)
            else:  # ``.float()`` and the shift in one pass
                shifted = torch.sub(logits, maximum.to(accumulate))
            target = self.target[start:end, None]
            if picked is not None:
                torch.gather(shifted, 1, target, out=picked[start:end])
            if weighted is not None:
                torch.mv(shifted, uniform, out=weighted[start:end])  # type: ignore[arg-type]
            exps = shifted.exp_()
            chunk_sums = torch.sum(exps, 1, out=sums[start:end])
            if not grads_wanted:
                continue
            # a softmax - (terms) = (exps - (terms) * sum / a) * a / sum
            row_factor = factor[start:end] / chunk_sums
            taken = chunk_sums.neg() if target_over is None else (target_over[start:end] * chunk_sums).neg_()
            exps.scatter_add_(1, target, taken[:, None])
            if spread_over is not None:
                exps.addr_(spread_over[start:end] * chunk_sums, uniform, alpha=-1)  # type: ignore[arg-type]
            if grad_bias is not None and capped is None:
                grad_bias.addmv_(exps.t(), row_factor)
            gradient = torch.mul(exps, row_factor[:, None], out=logits)  # in the products' dtype
            if capped is not None:  # through the cap: d(c tanh(z / c)) / dz = 1 - tanh(z / c)^2
                gradient.mul_(capped.mul_(capped).neg_().add_(1))
                if grad_bias is not None:
                    grad_bias += gradient.sum(0, dtype=accumulate)
            del exps, shifted, capped
            if grad_hidden is not None:
                torch.mm(gradient, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                if gradient.dtype == accumulate:
                    grad_weight.addmm_(gradient.t(), part)
                else:
                    grad_weight += gradient.t() @ part
            del gradient, logits
        if not loss:
            return torch.empty(0, dtype=accumulate, device=device), [grad_hidden, grad_weight, grad_bias]
        log_sums = sums.log_()
        losses = (1 - smoothing) * self.target_weight * (log_sums - picked.squeeze(1))  # type: ignore[union-attr]
        if smoothing:
            losses += (smoothing / classes) * self.valid * (uniform.sum() * log_sums - weighted)  # type: ignore[union-attr, operator]
        return losses, [grad_hidden, grad_weight, grad_bias]
