"""Op-level selective checkpointing (``policy="save_matmuls"`` / a callable): exact training state,
dropout masks, composition with buffer-exact recompute and offload, less recompute for more memory."""

from __future__ import annotations

import copy
import functools
import pickle
import weakref

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from bn_models import LitResNet, TinyResNet, image_batches, image_loader
from conftest import assert_bitwise_equal, run_grads
from exact import assert_same, assert_state_equal
from lit_models import LitGPT, token_loader
from models import TinyGPT, gpt_loss
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightmem import LightMem, apply_checkpointing, offload_activations
from lightmem.checkpoint import is_checkpointed, save_matmuls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")

_DROPOUT = torch.ops.aten.native_dropout


def _keep_activations_and_dropout(ctx, op, *args, **kwargs):
    """A callable policy with bool answers that also asks to keep dropout outputs."""
    return op.overloadpacket in (torch.ops.aten.gelu, torch.ops.aten.relu, torch.ops.aten.convolution, _DROPOUT)


POLICIES = {"save_matmuls": "save_matmuls", "callable": _keep_activations_and_dropout}


def _gpt(depth=4, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(depth=depth)  # train mode: dropout active (attention and MLP dropout in every block)
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(seed))
    return model, lambda m: gpt_loss(m, tokens)


class _Checkpointed:
    """run_grads' context factory: checkpoint with a policy, then maybe enter offload."""

    def __init__(self, policy, every_n=1, offload=None):
        self.policy, self.every_n, self.offload = policy, every_n, offload

    def __call__(self, model):
        apply_checkpointing(model, "Block", self.every_n, policy=self.policy)
        if self.offload is None:
            return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        return offload_activations(model, min_bytes=self.offload, devices=("cpu",))


@pytest.mark.parametrize("offload", [None, 0, "1MiB"], ids=["alone", "offload-min-0", "offload-default"])
@pytest.mark.parametrize("every_n", [1, 2])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradients_bitwise_equal_with_dropout(policy, every_n, offload):
    model, loss_fn = _gpt()
    expected, _ = run_grads(model, loss_fn)
    actual, _ = run_grads(model, loss_fn, _Checkpointed(POLICIES[policy], every_n, offload))
    assert_bitwise_equal(expected, actual)


class _TwoMasks(nn.Module):
    """Two random masks drawn by ``aten.bernoulli`` (CPU dropout draws in place with ``bernoulli_``;
    CUDA's fused ``native_dropout`` is an out-of-place random op like this one)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x * torch.bernoulli(torch.full_like(x, 0.5)))
        return self.fc2(h * torch.bernoulli(torch.full_like(h, 0.5)))


def _keep_first_mask(ctx, op, *args, **kwargs):
    """Keeps the first mask (width 16) and recomputes the second (width 32)."""
    if op.overloadpacket is torch.ops.aten.bernoulli:
        return args[0].shape[-1] == 16
    return op.overloadpacket is torch.ops.aten.addmm


def test_a_kept_random_op_would_shift_the_masks_after_it_so_random_ops_are_recomputed():
    torch.manual_seed(0)
    model = nn.Sequential(_TwoMasks())
    inputs = torch.randn(8, 16)

    def loss_fn(m):
        return m(inputs).square().sum()

    expected, _ = run_grads(model, loss_fn)

    def torch_selective_checkpoint(copied):
        # Negative control: torch's selective checkpoint with the same policy skips the kept first
        # mask in the recomputation, so the recomputed second mask is drawn from the first one's
        # RNG state.
        block = copied[0]
        plain_forward = block.forward
        block.forward = lambda x: checkpoint(
            plain_forward, x, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_first_mask),
        )  # fmt: skip
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    unguarded, _ = run_grads(model, loss_fn, torch_selective_checkpoint)
    assert not torch.equal(expected["0.fc1.weight"], unguarded["0.fc1.weight"])

    def lightmem_policy(copied):
        apply_checkpointing(copied, "0", policy=_keep_first_mask)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    assert_bitwise_equal(expected, run_grads(model, loss_fn, lightmem_policy)[0])


def _train_resnet(policy=None, every_n=1, offload=None, steps=4):
    """4 AdamW steps of TinyResNet (BatchNorm, Dropout2d, a step counter); model, optimizer, RNG state."""
    torch.manual_seed(0)
    model = TinyResNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if policy is not None:
        apply_checkpointing(model, ["ResBlock", "Head"], every_n, policy=policy)
    images, labels = image_batches(steps)
    torch.manual_seed(1)
    for step in range(steps):
        batch = slice(8 * step, 8 * step + 8)
        context = (
            offload_activations(model, min_bytes=offload, devices=("cpu",))
            if offload is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with context:
            loss = F.cross_entropy(model(images[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, torch.get_rng_state()


@pytest.mark.parametrize("offload", [None, 0, "1MiB"], ids=["alone", "offload-min-0", "offload-default"])
@pytest.mark.parametrize("every_n", [1, 2])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_whole_training_state_with_batchnorm_is_bitwise_equal(policy, every_n, offload):
    expected = _train_resnet()
    actual = _train_resnet(POLICIES[policy], every_n, offload)
    assert_state_equal(expected[0], actual[0], expected[1], actual[1])
    assert_same(expected[2], actual[2], "CPU RNG state")
    assert int(actual[0].blocks[0].bn1.num_batches_tracked) == 4
    assert int(actual[0].blocks[0].counter.steps) == 4


class _HeldAfterForward(TorchDispatchMode):
    """Bytes of the storages the forward's ops created that are still alive after the forward.

    With the loss alive, those are what the autograd graph (and selective checkpoint's cache)
    holds for backward, plus the logits and loss themselves.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in torch.utils._pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen = self.live.get(id(storage))
                if seen is None or seen[0]() is None:  # an id is reused once its storage is gone
                    self.live[id(storage)] = (weakref.ref(storage), storage.nbytes())
        return out

    def held_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.live.values() if ref() is not None)


def _held_bytes(policy) -> int:
    model, loss_fn = _gpt(depth=4)
    if policy is not None:
        apply_checkpointing(model, "Block", policy=policy)
    with _HeldAfterForward() as tracker:
        loss = loss_fn(model)
    held = tracker.held_bytes()
    loss.backward()
    return held


def test_save_matmuls_holds_strictly_between_no_checkpointing_and_full():
    none, matmuls, full = _held_bytes(None), _held_bytes("save_matmuls"), _held_bytes("full")
    assert full < matmuls < none, (full, matmuls, none)
    # The difference to full is the matmul outputs: per block qkv (4x32x192), q@k^T (4x4x32x32),
    # attn@v (4x4x32x16), proj (4x32x64), fc1 (4x32x256), fc2 (4x32x64), float32.
    per_block = 4 * 4 * (32 * 192 + 4 * 32 * 32 + 4 * 32 * 16 + 32 * 64 + 32 * 256 + 32 * 64)
    assert matmuls - full == 4 * per_block


def test_kept_outputs_stay_on_the_device_under_offload_only_block_inputs_move():
    # Torch's selective checkpoint holds the kept outputs in its own cache, not through saved-tensor
    # hooks: offload moves exactly the bytes it moves under full checkpointing.
    moved = {}
    for policy in ("full", "save_matmuls"):
        model, loss_fn = _gpt(depth=4)
        apply_checkpointing(model, "Block", policy=policy)
        with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
            loss = loss_fn(model)
        loss.backward()
        moved[policy] = off.stats.offloaded_bytes
    assert moved["save_matmuls"] == moved["full"] > 0


class _PolicySpy(pl.Callback):
    """Records the policy of every checkpointed block while training runs."""

    def __init__(self):
        self.policies: set = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.policies |= {m.forward.policy for m in pl_module.modules() if is_checkpointed(m)}


def _fit(callback=None, module_class=LitGPT, loader=token_loader, spy=None):
    pl.seed_everything(0, verbose=False)
    module = module_class()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[c for c in (callback, spy) if c is not None],
    )  # fmt: skip
    trainer.fit(module, loader())
    return module, trainer.optimizers[0]


@pytest.mark.parametrize("min_bytes", [0, "1MiB"], ids=["offload-min-0", "offload-default"])
@pytest.mark.parametrize(
    ("module_class", "loader", "targets"),
    [(LitGPT, token_loader, ["Block"]), (LitResNet, image_loader, ["ResBlock", "Head"])],
    ids=["gpt", "batchnorm-resnet"],
)
def test_lightning_fit_with_save_matmuls_is_bitwise_equal(module_class, loader, targets, min_bytes):
    expected = _fit(None, module_class, loader)
    callback = LightMem(
        checkpoint=targets, checkpoint_policy="save_matmuls", offload_devices=["cpu"], offload_min_bytes=min_bytes
    )
    spy = _PolicySpy()
    actual = _fit(callback, module_class, loader, spy)
    assert_state_equal(expected[0], actual[0], expected[1], actual[1])
    assert spy.policies == {"save_matmuls"}


def test_unknown_policy_names_the_flag_and_the_accepted_values():
    accepted = (
        "'full' (recompute the whole block), 'save_matmuls' (keep matmul, convolution and attention "
        "outputs, recompute the rest), or a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or bool"
    )
    with pytest.raises(ValueError) as error:
        apply_checkpointing(TinyGPT(depth=1), "Block", policy="matmuls")
    assert str(error.value) == f"apply_checkpointing(policy=...): expected {accepted}; got 'matmuls'"
    with pytest.raises(ValueError) as error:
        LightMem(checkpoint=["Block"], checkpoint_policy="none")
    assert str(error.value) == f"LightMem(checkpoint_policy=...): expected {accepted}; got 'none'"


def test_a_callable_that_cannot_take_ctx_and_op_fails_at_construction():
    def one_argument(op):
        return True

    with pytest.raises(ValueError) as error:
        LightMem(checkpoint=["Block"], checkpoint_policy=one_argument)
    assert str(error.value) == (
        "LightMem(checkpoint_policy=...): a callable policy is called as policy(ctx, op, *args, **kwargs); "
        "'one_argument' has the signature (op)"
    )


def test_a_policy_returning_something_else_fails_naming_the_flag():
    model, loss_fn = _gpt(depth=1)
    apply_checkpointing(model, "Block", policy=lambda ctx, op, *args, **kwargs: "save")
    with pytest.raises(TypeError, match=r"^apply_checkpointing\(policy=\.\.\.\): the policy must return a "):
        loss_fn(model)


def test_a_kept_output_changed_in_place_fails_at_forward_naming_the_op():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)))
    apply_checkpointing(model, "0", policy="save_matmuls")
    with pytest.raises(RuntimeError) as error:
        model(torch.randn(2, 4, requires_grad=True))
    assert str(error.value) == (
        "apply_checkpointing(policy=...): the policy keeps the output of aten.addmm.default for backward, "
        "and the block then changes that output in place (e.g. nn.ReLU(inplace=True) right after nn.Linear), "
        "so backward could not use it; make that op out-of-place, have the policy recompute "
        "aten.addmm.default, or use policy 'full'"
    )


def test_reapplying_with_another_policy_is_refused_and_with_the_same_one_wraps_once():
    model = TinyGPT(depth=2)
    first = apply_checkpointing(model, "Block", policy="save_matmuls")
    second = apply_checkpointing(model, "Block", policy="save_matmuls")
    assert model.blocks[0].forward.users == 2
    with pytest.raises(ValueError) as error:
        apply_checkpointing(model, "Block", policy="full")
    assert str(error.value) == (
        "apply_checkpointing(policy=...): block 'blocks.0' is already checkpointed with policy "
        "'save_matmuls'; remove that handle first to checkpoint it with 'full'"
    )
    second.remove()
    first.remove()
    assert "forward" not in model.blocks[0].__dict__


def test_deepcopy_and_pickle_keep_the_policy():
    model, loss_fn = _gpt(depth=2)
    apply_checkpointing(model, "Block", policy="save_matmuls")
    expected, _ = run_grads(model, loss_fn)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied.blocks[0].forward.policy == "save_matmuls"
        assert copied.blocks[0].forward.op_policy.policy is save_matmuls
        assert_bitwise_equal(expected, run_grads(copied, loss_fn)[0])


def test_save_matmuls_decides_by_op_for_every_overload():
    ops = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops.aten._scaled_dot_product_efficient_attention.default]  # fmt: skip
    assert all(save_matmuls(None, op) is CheckpointPolicy.MUST_SAVE for op in ops)
    others = [torch.ops.aten.gelu.default, torch.ops.aten.native_layer_norm.default, torch.ops.aten.add.Tensor]
    assert all(save_matmuls(None, op) is CheckpointPolicy.PREFER_RECOMPUTE for op in others)


def test_under_torch_compile_save_matmuls_keeps_state_and_gradients_exact():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU()), nn.Linear(8, 1))
    model = copy.deepcopy(plain)
    apply_checkpointing(model, ["1"], policy="save_matmuls")
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    for m in (plain, compiled):
        for _ in range(2):
            m(x).sum().backward()
    assert int(model[1][1].num_batches_tracked) == 2
    assert_state_equal(plain, model)
    assert_same({n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()})
