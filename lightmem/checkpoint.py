"""Selective activation checkpointing: chosen blocks recompute their activations in backward.

``apply_checkpointing`` replaces the ``forward`` of each chosen block, on the instance only, with a
call through non-reentrant ``torch.utils.checkpoint``. Module names, ``state_dict`` keys and
parameter identity do not change, so optimizers and saved checkpoints keep working, and the
returned handle restores the original forwards exactly.

The recomputation never updates a buffer a second time (BatchNorm statistics, step counters): see
``BufferSnapshots``. Non-reentrant checkpoint saves a block's inputs through the saved-tensor hooks
active outside the block, so inside ``offload_activations`` those inputs go to host memory too:
checkpoint plus offload keeps one block's activations on the device at a time.

The policy chooses what a checkpointed block keeps: ``"full"`` keeps only its inputs and recomputes
everything; ``"save_matmuls"`` (op-level selective checkpointing, built on torch's
``create_selective_checkpoint_contexts``) also keeps the outputs of matmuls, convolutions and
attention and recomputes only the cheap ops between them; a callable decides per aten op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lightmem.compiled import user_named_modules
from lightmem.config import parse_checkpoint_policy, parse_checkpoint_targets, parse_count, warn_once
from lightmem.matching import Target, select_outermost
from lightmem.recompute_state import ArgumentStates, cache_off_in_training, model_cache_argument


OpPolicy = Callable[..., Union[CheckpointPolicy, bool]]
CheckpointPolicyArg = Union[str, OpPolicy]

# Packets, not overloads: every overload of these ops (mm.default, mm.out, ...) is kept. Composite
# ops (matmul, linear, scaled_dot_product_attention) reach the dispatcher as the ops listed here.
_MATMUL_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_int_mm", "_scaled_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
)  # fmt: skip
MATMUL_OPS: frozenset = frozenset(
    getattr(torch.ops.aten, name) for name in _MATMUL_OP_NAMES if hasattr(torch.ops.aten, name)
)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"save_matmuls"`` policy: keep the outputs of matmul, convolution and attention ops."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _OpPolicy:
    """Runs a policy for torch's selective-checkpoint modes; random and mutating ops are recomputed.

    A random op (dropout) whose output were kept would not run again in the recomputation, so the
    random ops after it would draw from an RNG state shifted by one op and get different masks.
    Recomputing every random op from the restored RNG state gives each the mask of the forward. An
    op that writes its arguments (``add_``, BatchNorm's statistics) returns them: keeping that
    output keeps a tensor the forward goes on changing, which torch's cache refuses in backward.
    """

    def __init__(self, policy: OpPolicy, flag: str) -> None:
        self.policy = policy
        self.flag = flag

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = self.policy(ctx, op, *args, **kwargs)
        if isinstance(decision, bool):
            decision = CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.PREFER_RECOMPUTE
        elif not isinstance(decision, CheckpointPolicy):
            raise TypeError(
                f"{self.flag}: the policy must return a torch.utils.checkpoint.CheckpointPolicy or a bool; "
                f"got {decision!r} for {op}"
            )
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()) or op._schema.is_mutable:
            return CheckpointPolicy.MUST_RECOMPUTE
        return decision

    def keeps(self, op: Any, args: Any, kwargs: Any, output: Any) -> bool:
        """Whether a checkpointed block's forward keeps ``op``'s ``output`` (the estimator asks)."""
        if op in SAC_IGNORED_OPS:  # torch's selective checkpoint never asks about these
            return False
        context = _selective_context(output)
        return self(context, op, *args, **kwargs) in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _selective_context(output: Any) -> SelectiveCheckpointContext:
    """The context torch's selective checkpoint hands a policy in a forward: torch 2.13 gives the op's
    output with it (``op_output``), torch 2.11 does not (seen on a GPU machine)."""
    try:
        return SelectiveCheckpointContext(is_recompute=False, op_output=output)
    except TypeError:
        return SelectiveCheckpointContext(is_recompute=False)


class _KeptOutputs:
    """One forward of a block under a policy: the policy's decisions, and the outputs it keeps.

    torch's cache refuses, in backward, a kept output that the forward changed in place afterwards
    (``nn.ReLU(inplace=True)`` right after an ``nn.Linear`` under ``"save_matmuls"``). Checking the
    kept outputs' version counters when the block's forward ends reports it at the forward, naming
    the op and the flag. The references add no memory: torch's cache holds the same tensors.
    """

    def __init__(self, policy: _OpPolicy) -> None:
        self.policy = policy
        self.kept: list[tuple[Any, torch.Tensor, int]] = []

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = self.policy(ctx, op, *args, **kwargs)
        if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            for output in torch.utils._pytree.tree_leaves(getattr(ctx, "op_output", None)):
                if isinstance(output, torch.Tensor):
                    self.kept.append((op, output, output._version))
        return decision

    @contextlib.contextmanager
    def checked(self, outer: contextlib.AbstractContextManager, caching: Any) -> Iterator[None]:
        try:
            with outer, caching:
                yield
            for op, output, version in self.kept:
                if output._version != version:
                    raise RuntimeError(
                        f"{self.policy.flag}: the policy keeps the output of {op} for backward, and the "
                        "block then changes that output in place (e.g. nn.ReLU(inplace=True) right after "
                        f"nn.Linear), so backward could not use it; make that op out-of-place, have the "
                        f"policy recompute {op}, or use policy 'full'"
                    )
        finally:
            self.kept = []


def op_policy(policy: CheckpointPolicyArg, flag: str = "apply_checkpointing(policy=...)") -> _OpPolicy | None:
    """The per-op policy torch's selective checkpoint runs for ``policy``; None for ``"full"``."""
    if policy == "full":
        return None
    return _OpPolicy(save_matmuls if policy == "save_matmuls" else policy, flag)


class _Nested:
    """Two contexts entered as one. A class, not a generator: a retained graph recomputes the block
    once per backward, and checkpoint enters the same recompute context each time."""

    def __init__(self, outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager) -> None:
        self.outer = outer
        self.inner = inner
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.outer)
        stack.enter_context(self.inner)
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return self._stacks.pop().__exit__(*exc)


class BufferSnapshots:
    """Makes a block's recomputation leave its buffers alone and see them as its forward did.

    Recomputing a block in backward re-runs its forward in train mode: BatchNorm would take a second
    momentum update and ``num_batches_tracked`` would count twice, and a buffer updated in forward
    (a step counter) would be read with its post-forward value. So the recomputation runs with every
    buffer of the block swapped for a copy: the value it had before the forward for the buffers the
    forward updates, the current value for the others. The real buffers are never written by a
    recomputation, whatever the module does (BatchNorm's kernels write running statistics without
    bumping the version counter, so no detection is trusted for that part).

    The copies made at forward time are kept small: the first forward copies every buffer once and
    learns which ones it updates (by version counter or by value); later forwards copy only those.
    The recomputation's copies live as long as the recomputed block's graph (one block at a time).
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.updated: set[str] | None = None  # qualified names of the buffers the forward updates
        self._modules: list[tuple[str, nn.Module]] | None = None

    def _slots(self) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        # The block's submodules are listed once (this runs on every call); buffers are read fresh.
        if self._modules is None:
            self._modules = [
                (f"{prefix}." if prefix else "", module)
                for prefix, module in self.block.named_modules(remove_duplicate=False)
            ]
        return [
            (prefix + name, module, name, tensor)
            for prefix, module in self._modules
            if module._buffers
            for name, tensor in module._buffers.items()
            if tensor is not None
        ]

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for ``torch.utils.checkpoint``: a (forward, recompute) pair per call."""
        if not self._slots():
            return contextlib.nullcontext(), contextlib.nullcontext()
        before: dict[str, torch.Tensor] = {}
        return self._forward(before), self._recompute(before)

    @contextlib.contextmanager
    def _forward(self, before: dict[str, torch.Tensor]) -> Iterator[None]:
        slots = self._slots()
        versions = [tensor._version for _, _, _, tensor in slots]
        with torch.no_grad():
            for qualified, _, _, tensor in slots:
                if self.updated is None or qualified in self.updated:
                    before[qualified] = tensor.detach().clone()
        yield
        updated = {
            qualified
            for (qualified, _, _, tensor), version in zip(slots, versions)
            if tensor._version != version or (qualified in before and _values_changed(tensor, before[qualified]))
        }
        for qualified in [name for name in before if name not in updated]:
            del before[qualified]  # the recomputation copies the current value
        self.updated = updated if self.updated is None else self.updated | updated

    def _recompute(self, before: dict[str, torch.Tensor]) -> _SwappedBuffers:
        return _SwappedBuffers(self, before)

    def scratch(self) -> _SwappedBuffers:
        """Run the block on copies of its buffers' current values: what it writes to them is
        dropped (entered, it gives ``{qualified name: copy}``, to read what the block wrote)."""
        return _SwappedBuffers(self, {}, tell=True)


def _values_changed(tensor: torch.Tensor, before: torch.Tensor) -> bool:
    # Fake tensors (the estimator's dry run) have no values: there the version counter decides.
    if is_fake(tensor) or torch.compiler.is_compiling():
        return False
    return not torch.equal(tensor, before)


class _SwappedBuffers:
    """The recompute context: re-entered once per recomputation (a retained graph recomputes again)."""

    def __init__(self, snapshots: BufferSnapshots, before: dict[str, torch.Tensor], *, tell: bool = False) -> None:
        self.snapshots = snapshots
        self.before = before
        self.tell = tell  # keep what the block wrote (a recomputation keeps nothing: its copies die with it)
        self.swapped: list[tuple[str, nn.Module, str, torch.Tensor]] = []
        self.written: dict[str, torch.Tensor] = {}

    def __enter__(self) -> dict[str, torch.Tensor]:
        """With ``tell``, the buffers as the block left them, by qualified name: filled at exit."""
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for qualified, module, name, tensor in self.snapshots._slots():
                # Fresh copies each time, so a second recomputation starts from the same values.
                if id(tensor) not in copies:  # a buffer shared by two submodules is copied once
                    copies[id(tensor)] = self.before.get(qualified, tensor).detach().clone()
                self.swapped.append((qualified, module, name, tensor))
                module._buffers[name] = copies[id(tensor)]
        self.written = {}
        return self.written

    def __exit__(self, *exc: object) -> None:
        swapped, self.swapped = self.swapped, []
        for qualified, module, name, tensor in swapped:
            if self.tell:
                self.written[qualified] = module._buffers[name]
            module._buffers[name] = tensor


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _run_time_contexts(
    wrapper: CheckpointedForward,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The contexts of a checkpoint call that Dynamo traced: chosen when checkpoint runs.

    Traced into the graph (called while compiling), torch's selective-checkpoint modes are the only
    contexts compile accepts, and none is needed for buffers: AOTAutograd's recomputation is part of
    the compiled backward and applies no buffer update. Run eagerly because the block breaks the
    graph, the eager contexts protect the buffers from a second update, as without compile.
    """
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(wrapper.op_policy or _always_recompute)
    return wrapper.contexts()


def restore_forward(module: nn.Module, wrapper: Any) -> None:
    """Put back what an instance-forward wrapper (``CheckpointedForward``, the tiling's
    ``TiledForward``) replaced: the instance's own ``forward``, or none (the class's)."""
    if wrapper.had_instance_forward:
        module.forward = wrapper.inner
    else:
        del module.forward


def release_forward(module: nn.Module, kind: type) -> None:
    """One call's share of ``module``'s ``kind`` wrapper given back; the last one unwraps it."""
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, kind):
        wrapper.users -= 1
        if wrapper.users == 0:
            restore_forward(module, wrapper)


class CheckpointedForward:
    """The instance ``forward`` of a checkpointed block.

    A plain picklable object (not a closure), so ``copy.deepcopy`` and ``pickle`` of the model
    rebind it to the copied module. Without grad (validation, inference) the block runs as usual.
    A call that gets a model cache runs without checkpointing, and a forward that changes state
    held by its arguments raises (see ``lightmem.recompute_state``).
    """

    dry_run_copies = True
    """Copied into the estimator's stand-in of the model, bound to its block (``lightmem.estimate.trace.stand_in``)."""

    def __init__(
        self, inner: Any, had_instance_forward: bool, block: nn.Module,
        policy: CheckpointPolicyArg = "full",
        policy_flag: str = "apply_checkpointing(policy=...)",
        name: str = "",
    ) -> None:
        self.inner = inner
        self.name = name
        self.block_class = type(block).__name__
        self.had_instance_forward = had_instance_forward
        self.users = 0
        self.buffers = BufferSnapshots(block)
        self.policy = policy
        self.op_policy = op_policy(policy, policy_flag)
        # A partial of a plain function: the only context_fn Dynamo accepts besides a function.
        self.run_time_contexts = functools.partial(_run_time_contexts, self)

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn``: buffer-exact recompute, and torch's selective-checkpoint modes for a policy.

        The buffer copies are made outside the selective-checkpoint modes, so their clones are not
        counted as ops of the block (the forward copies fewer buffers than the recomputation).
        """
        forward, recompute = self.buffers.contexts()
        if self.op_policy is None:
            return forward, recompute
        kept = _KeptOutputs(self.op_policy)
        caching, cached = create_selective_checkpoint_contexts(kept)
        return kept.checked(forward, caching), _Nested(recompute, cached)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        # preserve_rng_state: dropout in the recomputation draws the same mask as in forward. The
        # block's keyword arguments are bound first, so one named like a checkpoint option
        # (debug, context_fn, ...) reaches the block, not checkpoint.
        function = functools.partial(self.inner, **kwargs) if kwargs else self.inner
        if torch.compiler.is_compiling():
            # Dynamo traces this call. checkpoint either becomes part of the compiled graph, or, when
            # the block breaks the graph, Dynamo runs the checkpoint call itself eagerly: which of the
            # two happens is known only when checkpoint asks for its contexts (_run_time_contexts).
            return checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=self.run_time_contexts
            )
        cache = model_cache_argument(args, kwargs)
        if cache is not None:
            warn_once(
                f"lightmem: {self.block_class} got a cache ({type(cache).__name__}) in a forward with grad enabled "
                "(use_cache=True in eval mode, or a cache passed in): such calls run without checkpointing, "
                "so backward never recomputes into the cache their forward filled"
            )
            return self.inner(*args, **kwargs)
        states = ArgumentStates(args, kwargs)
        output = checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=self.contexts)
        states.check(self.name, self.block_class, self.inner)
        return output


def is_checkpointed(module: nn.Module) -> bool:
    """True when ``apply_checkpointing`` has wrapped ``module``."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


class CheckpointHandle:
    """What ``apply_checkpointing`` returns.

    Attributes:
        modules: qualified names of the blocks this call checkpoints, in module order.
    """

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        self.modules: list[str] = list(modules)
        self._blocks = list(modules.values())
        self._removed = False
        # Training forwards of the models around these blocks run without a cache (Hugging Face's
        # use_cache): a recompute must not see or fill a cache the forward filled.
        self._cache_hooks = cache_off_in_training(model, self.modules)

    def remove(self) -> None:
        """Undo this call. A block applied by several calls unwraps when the last one is removed."""
        if self._removed:
            return
        self._removed = True
        for hook in self._cache_hooks:
            hook.remove()
        for block in self._blocks:
            release_forward(block, CheckpointedForward)

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self) -> str:
        return f"CheckpointHandle(modules={self.modules!r})"


def select_blocks(
    model: nn.Module,
    targets: Target | Iterable[Target],
    every_n: int = 1,
    *,
    targets_flag: str = "apply_checkpointing(targets=...)",
    every_n_flag: str = "apply_checkpointing(every_n=...)",
) -> dict[str, nn.Module]:
    """The blocks ``apply_checkpointing`` would wrap: outermost matches, every n-th in module order."""
    parse_count(every_n, flag=every_n_flag)
    targets = parse_checkpoint_targets(targets, flag=targets_flag)
    outermost = select_outermost(model, targets, flag=targets_flag)
    return {name: outermost[name] for name in list(outermost)[::every_n]}


def apply_checkpointing(
    model: nn.Module,
    targets: Target | Iterable[Target],
    every_n: int = 1,
    policy: CheckpointPolicyArg = "full",
    *,
    policy_flag: str = "apply_checkpointing(policy=...)",
    targets_flag: str = "apply_checkpointing(targets=...)",
    every_n_flag: str = "apply_checkpointing(every_n=...)",
) -> CheckpointHandle:
    """Checkpoint the blocks of ``model`` selected by ``targets``.

    Args:
        model: the model whose blocks to wrap (in place).
        targets: class names (``"GPT2Block"``), ``nn.Module`` classes, or glob patterns over
            qualified module names (``"encoder.layers.*"``), mixed freely. A class name matches
            subclasses too (FSDP2's ``FSDPGPT2Block``, a user's ``MyBlock(GPT2Block)``). When a
            block and one of its descendants both match, only the outer block is wrapped.
        every_n: wrap every n-th matched block in module order (the 1st, the (n+1)-th, ...), to
            trade memory for recompute time.
        policy_flag, targets_flag, every_n_flag: how error messages name those arguments
            (``LightMem`` passes its own flag names).

    Returns:
        A :class:`CheckpointHandle` with ``.modules`` and ``.remove()``. Applying to a block that is
        already checkpointed does not wrap it twice.

    Raises:
        ValueError: a target matches no module (the message lists the closest module and class
            names), ``every_n`` is not an integer >= 1, ``policy`` is none of the above, or a
            block is already checkpointed with a different policy.

    Example::

        >>> from torch import nn
        >>> from lightmem import apply_checkpointing
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4)])
        >>> handle = apply_checkpointing(model, ["[0-9]"], every_n=2)
        >>> handle.modules
        ['0', '2']
        >>> handle.remove()
    """
    policy = parse_checkpoint_policy(policy, flag=policy_flag)
    blocks = select_blocks(model, targets, every_n, targets_flag=targets_flag, every_n_flag=every_n_flag)
    for name, block in blocks.items():
        wrapper = block.__dict__.get("forward")
        if isinstance(wrapper, CheckpointedForward) and wrapper.policy is not policy and wrapper.policy != policy:
            raise ValueError(
                f"{policy_flag}: block {name or type(block).__name__!r} is already checkpointed with "
                f"policy {wrapper.policy!r}; remove that handle first to checkpoint it with {policy!r}"
            )
    for name, block in blocks.items():
        wrapper = block.__dict__.get("forward")
        if not isinstance(wrapper, CheckpointedForward):
            had_instance_forward = "forward" in block.__dict__
            wrapper = CheckpointedForward(block.forward, had_instance_forward, block, policy, policy_flag, name)
            block.forward = wrapper
        wrapper.users += 1
    return CheckpointHandle(model, blocks)


def existing_checkpointing(strategy: Any, model: nn.Module) -> str | None:
    """Why ``model`` is already checkpointed by someone other than lightmem, or None.

    Recognised: Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)`` (FSDP1, which
    wraps blocks after LightMem's setup), a ``DeepSpeedStrategy`` whose config turns on
    ``activation_checkpointing`` (``partition_activations`` or ``cpu_checkpointing``),
    ``torch.distributed`` ``checkpoint_wrapper`` modules, and Hugging Face models with
    ``gradient_checkpointing`` enabled. LightMem then leaves checkpointing to them (and says so);
    activation offload stays on under every strategy.
    """
    if getattr(strategy, "_activation_checkpointing_kwargs", None):
        return f"the {type(strategy).__name__} already checkpoints (activation_checkpointing_policy)"
    config = getattr(strategy, "config", None)
    if isinstance(config, dict):
        section = config.get("activation_checkpointing") or {}
        if section.get("partition_activations") or section.get("cpu_checkpointing"):
            return "DeepSpeed activation checkpointing is configured"
    for name, module in user_named_modules(model):
        if type(module).__name__ == "CheckpointWrapper" or hasattr(module, "_checkpoint_wrapped_module"):
            return f"module {name or type(module).__name__!r} is already a checkpoint wrapper"
        if getattr(module, "gradient_checkpointing", False) is True:
            return f"module {name or type(module).__name__!r} has gradient_checkpointing enabled"
    return None
