"""A Hugging Face causal language model's own loss (``model(input_ids, labels=labels).loss``)
computed by ``lightmem.linear_cross_entropy``, without the logits ever being made.

The model's forward runs as written (every argument, mixture-of-experts auxiliary losses
included) with two hooks: the output head (``model.get_output_embeddings()``) is handed the
hidden states sliced to no position, so it makes logits of zero positions, and the model's
``loss_function`` (transformers 5's ``ForCausalLMLoss``, replaced on the instance) computes the
loss from the hidden states the head was given, with the head's weight and bias: the same shift
of the labels, ``ignore_index``, ``shift_labels`` and ``num_items_in_batch`` as
``ForCausalLMLoss``. Only a training forward with labels (module in train mode, gradients on) is
changed; evaluation and generation run untouched.

What the forward does to the head's output before its loss reads it is read where it runs: the
ops applied to the (zero-position) head output until the loss function is called
(``lightmem.logit_transform``). Gemma-2's soft-capping (``tanh(logits / c) * c``) is carried:
``linear_cross_entropy(..., softcap=c)`` caps each chunk as the model caps the logits.

Not covered, and refused with a message when met: a model whose loss is not transformers'
``ForCausalLMLoss`` called from its forward (encoder-decoders such as T5, whose forward computes
its loss itself; masked LMs; a custom ``loss_function``); a model that changes the logits between
its head and its loss otherwise (Cohere's logit scale): the first training forward names the ops; a
head that is not a plain ``nn.Linear``. The output's ``logits`` are of zero positions in such a forward.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightmem.config import parse_count
from lightmem.logit_transform import COPIES, LogitTransform, is_view, read_transform
from lightmem.loss import linear_cross_entropy


class ChunkedCausalLMLoss:
    """The hooks ``chunked_causal_lm_loss`` put on one model; ``remove()`` takes them off."""

    dry_run_copies = True
    """The estimator's stand-in of the model gets its own copy (``lightmem.estimate.trace.stand_in``): plain
    state, whose model and head are then the stand-in's."""

    def __init__(self, model: nn.Module, head: nn.Linear, chunk_rows: int | None) -> None:
        self.model, self.head, self.chunk_rows = model, head, chunk_rows
        self._own_loss = model.__dict__.get("_loss_function")
        self._hidden: torch.Tensor | None = None
        self._head_output: torch.Tensor | None = None
        self._between: _AfterHead | None = None
        self._armed = False
        self._labels_at = _positional_index(model.forward, "labels")
        self._handles = [
            model.register_forward_pre_hook(self._arm, with_kwargs=True),
            model.register_forward_hook(self._disarm, always_call=True),
            head.register_forward_pre_hook(self._take_hidden),
            head.register_forward_hook(self._note_output),
        ]
        model.loss_function = self._loss

    def remove(self) -> None:
        """The model as it was: its hooks gone, its own ``loss_function`` back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._own_loss is None:
            self.model.__dict__.pop("_loss_function", None)
        else:
            self.model.loss_function = self._own_loss

    def _arm(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        labels = kwargs.get("labels")
        if labels is None and self._labels_at is not None and len(args) > self._labels_at:
            labels = args[self._labels_at]
        self._armed = labels is not None and module.training and torch.is_grad_enabled()
        self._hidden = self._head_output = None

    def _disarm(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stop_reading()
        hidden, self._hidden, self._head_output, armed = self._hidden, None, None, self._armed
        self._armed = False
        if sys.exc_info()[1] is not None:  # called as the forward raised: only the state is cleared
            return
        if armed and hidden is not None:
            raise RuntimeError(
                f"lightmem: chunked loss: {type(module).__name__}'s forward did not call its loss_function with the "
                "logits of its output head, so the loss cannot be chunked; compute the loss yourself with "
                "lightmem.linear_cross_entropy, or leave chunked_loss off"
            )

    def _take_hidden(self, head: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self._armed:
            return None
        hidden = args[0]
        self._hidden = hidden
        return (hidden.narrow(-2, 0, 0), *args[1:])  # logits of zero positions: nothing is made

    def _note_output(self, head: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self._armed:
            self._stop_reading()
            self._head_output = output
            self._between = _AfterHead(output)
            self._between.__enter__()

    def _stop_reading(self) -> _AfterHead | None:
        """The ops read since the head's output, the reading stopped (None: none was being read)."""
        between, self._between = self._between, None
        if between is not None:
            between.__exit__(None, None, None)
        return between

    def _transform(self, logits: torch.Tensor) -> LogitTransform | None:
        """What the forward did to the head's output to make ``logits`` (None: they are not made from it)."""
        between = self._stop_reading()
        if logits is self._head_output:
            return LogitTransform()
        if between is None or id(logits) not in between.made:
            return None
        return read_transform(between.steps)

    def _loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        hidden = self._hidden
        if hidden is None:  # not a training forward with labels: the model's own loss, on real logits
            own = self._own_loss or _causal_lm_loss()
            return own(
                logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )  # fmt: skip
        self._hidden = None
        transform = self._transform(logits)
        if transform is None or not transform.carried:
            ops = "" if transform is None else f" ({', '.join(transform.others)})"
            raise RuntimeError(
                f"lightmem: chunked loss: {type(self.model).__name__} changes its output head's logits before its "
                f"loss{ops}, which a chunked loss would leave out (it carries a soft-cap only); compute the loss "
                "yourself with lightmem.linear_cross_entropy, or leave chunked_loss off"
            )
        if shift_labels is None:  # as ForCausalLMLoss: position t predicts the token at t + 1
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(hidden.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = linear_cross_entropy(
            hidden, self.head.weight, shift_labels, bias=self.head.bias, ignore_index=ignore_index,
            reduction=reduction, chunk_rows=self.chunk_rows, softcap=transform.softcap,
        )  # fmt: skip
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


class _AfterHead(TorchDispatchMode):
    """Reads the ops a forward applies to its head's output (zero positions of it: nothing costly)
    and to what it makes from it, until the loss function is called: the steps
    ``read_transform`` reads (views and copies left out)."""

    def __init__(self, head_output: torch.Tensor) -> None:
        super().__init__()
        self.made: dict[int, torch.Tensor] = {id(head_output): head_output}
        """Tensors made from the head's output, by id (held, so that no id is reused meanwhile)."""
        self.steps: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(isinstance(leaf, torch.Tensor) and id(leaf) in self.made for leaf in tree_leaves((args, kwargs))):
            made = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
            for leaf in made:
                self.made[id(leaf)] = leaf
            if made and func not in COPIES and not is_view(func):  # (a fake tensor's device query makes none)
                numbers = tuple(arg for arg in args if type(arg) is float or type(arg) is int)
                self.steps.append((func._overloadpacket.__name__, numbers))
        return out


def chunked_causal_lm_loss(model: nn.Module, *, chunk_rows: int | None = None) -> ChunkedCausalLMLoss:
    """Make a Hugging Face causal LM's training loss (``model(..., labels=labels).loss``) chunked:
    ``lightmem.linear_cross_entropy`` from the hidden states, the logits never made (module
    docstring). ``LightMem(chunked_loss=True)`` does this for a LightningModule's causal LMs.

    Args:
        model: a transformers causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) whose
            ``loss_function`` is transformers' ``ForCausalLMLoss``.
        chunk_rows: rows of logits made at a time (None: ``linear_cross_entropy``'s default).

    Returns:
        A handle; ``remove()`` gives the model back as it was.

    Raises:
        ValueError: ``model`` is not such a model (the message says what it lacks).

    Example::

        >>> import torch, transformers, lightmem
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1000)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> handle = lightmem.chunked_causal_lm_loss(model)
        >>> ids = torch.randint(0, 1000, (2, 16))
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.loss.backward()
        >>> out.logits.shape  # no position's logits were made
        torch.Size([2, 0, 1000])
        >>> handle.remove()
    """
    parse_count(chunk_rows, flag="chunked_causal_lm_loss(chunk_rows=...)", allow_none=True)
    reason = not_a_causal_lm(model)
    if reason is not None:
        raise ValueError(f"chunked_causal_lm_loss(model=...): {reason}")
    return ChunkedCausalLMLoss(model, model.get_output_embeddings(), chunk_rows)


LITGPT_OPTION = (
    "LitGPT's own option is its forward's lm_head_chunk_size=... with litgpt.utils.chunked_cross_entropy; "
    "lightmem.linear_cross_entropy computes the loss from what its lm_head reads, the logits never whole"
)


def litgpt_models(module: nn.Module) -> list[nn.Module]:
    """The LitGPT models in ``module`` (itself included): they return logits and leave the loss to the
    user's code, so no hook can chunk it."""
    return [sub for sub in module.modules() if type(sub).__module__.split(".")[0] == "litgpt" and hasattr(sub, "lm_head")]


def not_a_causal_lm(model: nn.Module) -> str | None:
    """Why ``chunked_causal_lm_loss`` cannot take ``model`` (None: it can)."""
    name = type(model).__name__
    if litgpt_models(model)[:1] == [model]:
        return f"{name} is a LitGPT model, which returns logits and leaves the loss to your code: {LITGPT_OPTION}"
    get_head = getattr(model, "get_output_embeddings", None)
    if get_head is None or not hasattr(type(model), "loss_function"):
        return f"{name} is not a Hugging Face model with an output head and a loss_function"
    head = get_head()
    if not isinstance(head, nn.Linear):
        return f"{name}'s output head is {type(head).__name__}, not a plain nn.Linear"
    own = model.__dict__.get("_loss_function")
    if own is not None and isinstance(getattr(own, "__self__", None), ChunkedCausalLMLoss):
        return f"{name}'s loss is chunked already"
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder; only a causal LM's loss is chunked"
    if "loss_function" not in _source(type(model).forward):
        return f"{name} computes its loss without its loss_function"
    if model.loss_function is not _causal_lm_loss():
        return f"{name}'s loss_function is {getattr(model.loss_function, '__name__', model.loss_function)!r}, not transformers' ForCausalLMLoss"
    return None


def _source(function: Any) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def causal_lms(module: nn.Module) -> list[nn.Module]:
    """The outermost modules of ``module`` (itself included) that ``chunked_causal_lm_loss`` takes."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        if not_a_causal_lm(sub) is None:
            found.append(sub)
            inside.update(id(inner) for inner in sub.modules())
    return found


def _causal_lm_loss() -> Any:
    from transformers.loss.loss_utils import ForCausalLMLoss  # transformers is optional: asked for here only

    return ForCausalLMLoss


def _positional_index(forward: Any, name: str) -> int | None:
    """Where ``name`` sits among ``forward``'s positional parameters (None: keyword only, or absent)."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None
