"""The engine's edges: in-place changes through aliases, parameters it never moves (also those of
sharded models), the hook stack whatever the exit order, threads, and torch.func."""

from __future__ import annotations

import threading
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightmem import LightMem, offload_activations
from lightmem.offload.context import TORCH_FUNC_MESSAGE


def _hooks_top():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


# -- in-place changes -------------------------------------------------------------------------


def _save_then_change_through_detached_alias() -> torch.Tensor:
    x = torch.ones(1024, requires_grad=True)  # 4 KiB storages
    y = x * 2
    alias = y.detach()  # same storage, same version counter
    z = y.sin()  # saves y
    del y  # the saved tensor's Python object is gone
    alias.mul_(3)
    return z


@pytest.mark.parametrize("min_bytes", [0, "1MiB"], ids=["offloaded", "kept"])
def test_in_place_change_through_a_detached_alias_raises_like_autograd(min_bytes):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _save_then_change_through_detached_alias().sum().backward()
    with offload_activations(min_bytes=min_bytes, devices=("cpu",)) as off:
        z = _save_then_change_through_detached_alias()
    expected = (
        r"modified by an inplace operation: \[torch.FloatTensor \[1024\]\] "
        r"is at version 1; expected version 0 instead"
    )
    with pytest.raises(RuntimeError, match=expected):
        z.sum().backward()
    assert (off.stats.offloaded_tensors, off.stats.kept_bytes) == ((1, 0) if min_bytes == 0 else (0, 4096))


def _change_after_the_copy(keep):
    """Saves ``y`` (4 KiB), lets the copy to host run, then doubles it through what ``keep`` kept."""
    x = torch.ones(1024, requires_grad=True)
    y = x * 2
    kept = y if keep == "tensor" else y[:512] if keep == "view" else y.detach()
    z = y.sin()  # saves y
    w = z.cos()  # a later op's save: the copy of y runs here
    del y
    kept.mul_(2)
    return w


@pytest.mark.parametrize("keep", ["tensor", "view", "detached alias"])
def test_in_place_change_after_the_copy_to_host_raises_through_any_alias(keep):
    # The version holder is skipped only when nothing can write the storage any more; each of
    # these aliases can, and must still be caught after its storage's copy ran.
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        w = _change_after_the_copy(keep)
    assert off.stats.offloaded_tensors == 2
    with pytest.raises(RuntimeError, match=r"\[torch.FloatTensor \[1024\]\] is at version 1; expected version 0"):
        w.sum().backward()


def test_saved_tensor_nothing_else_refers_to_needs_no_version_holder():
    # The cheap path, taken where it is exact: the tensor and its storage are gone once copied.
    x = torch.randn(32, 32, requires_grad=True)

    def chain():
        y = x
        for _ in range(20):
            y = y.sin()
        return y.sum()

    (expected,) = torch.autograd.grad(chain(), x)
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        loss = chain()
    entries = [ref() for ref in off._offloader._session.refs]
    assert [entry.version_holder is not None for entry in entries] == [True] + [False] * 19  # x is held
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.equal(grad, expected)


def _use_counts(tensor: torch.Tensor) -> tuple[int, int]:
    """(owners of the tensor in C++, tensors on its storage + 1 for the storage object made here)."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def test_use_counts_read_by_the_version_holder_skip_are_as_assumed():
    # release_source relies on these counts; a PyTorch change to them must fail here first.
    y = torch.randn(8, requires_grad=True).sin()  # sin saves its input, not y
    alone = _use_counts(y)
    detached = y.detach()  # another tensor on the storage; the tensor itself has no new owner
    with_detached = _use_counts(y)
    del detached
    view = y[:4]  # a view owns its base
    with_view = _use_counts(y)
    del view
    saved = y.sin()  # autograd saves y in C++
    with_saved = _use_counts(y)
    del saved
    assert (alone, with_detached, with_view, with_saved, _use_counts(y)) == ((1, 2), (1, 3), (2, 3), (2, 2), (1, 2))


# -- parameters, also those created after enter (FSDP's unsharded weights) ----------------------


def test_parameter_created_after_enter_and_its_views_are_never_offloaded():
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        weight = nn.Parameter(torch.randn(256, 256))  # unknown at enter, like an all-gathered weight
        y = x @ weight.t()  # saves x and a view of the parameter
        z = torch.nn.functional.linear(x, weight)  # saves x and the parameter
        with torch.autocast("cpu", dtype=torch.bfloat16):
            w = torch.nn.functional.linear(x, weight)  # saves bf16 copies of x and of the parameter
    (y.sum() + z.sum() + w.float().sum()).backward()
    expected = torch.autograd.grad(
        (x @ weight.t()).sum() + torch.nn.functional.linear(x, weight).sum()
        + _bf16_linear(x, weight).float().sum(), [x, weight]
    )  # fmt: skip
    assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])
    # x once (deduplicated for its second save) and its bf16 copy; nothing of the weight
    assert off.stats.offloaded_bytes == 256 * 256 * 4 + 256 * 256 * 2
    assert off.stats.deduplicated_bytes == 256 * 256 * 4


def _bf16_linear(x, weight):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.nn.functional.linear(x, weight)


def test_saved_tensor_on_a_freed_storage_is_left_untouched():
    left = torch.randn(0, 64, requires_grad=True)
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        full = torch.randn(64, 64) * 2
        empty_view = full[:0]
        full.untyped_storage().resize_(0)  # freed, as FSDP2 frees an unsharded weight after forward
        out = left * empty_view  # saves empty_view, whose storage now has no memory
    out.sum().backward()
    assert left.grad.shape == (0, 64)
    assert (off.stats.packed_tensors, off.stats.offloaded_tensors, off.stats.kept_bytes) == (1, 0, 0)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fully_shard_on_one_process_offloads_no_weight(tmp_path, reshard_after_forward):
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
        reference = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
        reference.load_state_dict(model.state_dict())
        for layer in (model[0], model[2]):
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        x = torch.randn(64, 128)
        reference(x).square().sum().backward()
        with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
            loss = model(x).square().sum()
        loss.backward()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad.full_tensor(), ref.grad), name
        # the input (32 KiB), the ReLU output (64 KiB) saved twice, the last output (32 KiB)
        assert off.stats.offloaded_bytes == 64 * 128 * 4 + 64 * 256 * 4 + 64 * 128 * 4
    finally:
        dist.destroy_process_group()


# -- the hook stack, whatever the exit order ------------------------------------------------------


def test_contexts_exited_out_of_order_leave_the_hook_stack_correct():
    x = torch.randn(512, requires_grad=True)
    first = offload_activations(min_bytes=0, devices=("cpu",))
    second = offload_activations(min_bytes=0, devices=("cpu",))
    first.__enter__()
    second.__enter__()
    expected = (
        r"^offload_activations: exited out of order: 1 saved-tensor hooks context\(s\) entered after it "
        r"are still active\. lightmem removed its own hooks and left those in place"
    )
    with pytest.raises(RuntimeError, match=expected):
        first.__exit__(None, None, None)
    packed = first.stats.packed_tensors
    x.exp().sum().backward()  # the hooks left in place are the second context's: they pack, the first's do not
    assert (first.stats.packed_tensors, second.stats.packed_tensors) == (packed, 1)
    second.__exit__(None, None, None)
    assert _hooks_top() is None
    packed = first.stats.packed_tensors
    x.exp().sum().backward()  # a later forward: no stale hooks pack it
    assert first.stats.packed_tensors == packed


def test_exit_with_foreign_hooks_inside_keeps_theirs_and_removes_ours():
    off = offload_activations(devices=("cpu",))
    off.__enter__()
    inner = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    inner.__enter__()
    with pytest.raises(RuntimeError, match="exited out of order"):
        off.__exit__(None, None, None)
    assert _hooks_top()[0] is inner.pack_hook
    inner.__exit__()
    assert _hooks_top() is None


def test_our_hooks_popped_by_a_foreign_exit_give_a_clear_error():
    outer = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    outer.__enter__()
    off = offload_activations(devices=("cpu",))
    off.__enter__()
    outer.__exit__()  # torch pops the top of the stack: ours
    with pytest.raises(RuntimeError, match="already removed by the exit of a context entered before it"):
        off.__exit__(None, None, None)
    assert _hooks_top()[0] is outer.pack_hook  # outer's own hooks: it thinks they are gone
    torch._C._autograd._pop_saved_tensors_default_hooks()


def test_out_of_order_exit_during_an_exception_warns_and_keeps_the_exception():
    first = offload_activations(devices=("cpu",))
    second = offload_activations(devices=("cpu",))
    first.__enter__()
    second.__enter__()
    with pytest.warns(UserWarning, match="exited out of order"):
        first.__exit__(ValueError, ValueError("user error"), None)
    second.__exit__(None, None, None)
    assert _hooks_top() is None


def test_entering_an_active_context_again_is_an_error():
    off = offload_activations(devices=("cpu",))
    with off:
        with pytest.raises(RuntimeError, match="already active; it cannot be nested"):
            off.__enter__()
    assert _hooks_top() is None


# -- threads --------------------------------------------------------------------------------------


def test_one_context_entered_from_two_threads_is_an_error():
    off = offload_activations(devices=("cpu",))
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def worker():
        with off:
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(10)
    try:
        with pytest.raises(RuntimeError, match="already active in another thread; saved-tensor hooks are"):
            off.__enter__()
        with pytest.raises(RuntimeError, match="exited from another thread than the one that entered it"):
            off.__exit__(None, None, None)
    except BaseException as error:  # noqa: BLE001 - let the worker finish before failing
        errors.append(error)
    release.set()
    thread.join(10)
    assert not errors, errors
    assert not off.active and _hooks_top() is None


def test_a_forward_in_another_thread_is_not_offloaded():
    x = torch.randn(1024, requires_grad=True)
    results = []
    with offload_activations(min_bytes=0, devices=("cpu",)) as off:
        thread = threading.Thread(target=lambda: results.append(x.exp()))
        thread.start()
        thread.join()
    results[0].sum().backward()
    assert off.stats.packed_tensors == 0  # hooks are per thread (documented in docs/offload-protocol.md)


# -- torch.func ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "transform",
    [
        lambda x: torch.func.grad(lambda a: a.sin().sum())(x),
        lambda x: torch.func.vjp(lambda a: a.sin(), x),
        lambda x: torch.func.vmap(torch.func.grad(lambda a: a.sin().sum()))(x[None]),
    ],
    ids=["grad", "vjp", "vmap-grad"],
)
def test_torch_func_inside_the_context_raises_lightmems_message(transform):
    x = torch.randn(8)
    with pytest.raises(RuntimeError) as caught:
        with offload_activations(devices=("cpu",)):
            transform(x)
    assert str(caught.value).startswith(TORCH_FUNC_MESSAGE + "\n(torch said: torch.func.{grad, vjp")
    assert _hooks_top() is None
    transform(x)  # outside the context it runs


class _FuncInTrainingStep(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        torch.func.grad(lambda a: a.sin().sum())(x)
        return self.layer(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_torch_func_in_a_training_step_under_lightmem_raises_lightmems_message():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[LightMem(offload_devices=["cpu"], metrics=[])],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError) as caught:
            trainer.fit(_FuncInTrainingStep(), loader)
    assert str(caught.value).startswith(TORCH_FUNC_MESSAGE)
    assert _hooks_top() is None
