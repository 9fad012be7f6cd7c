"""Model-state offload under CUDA's real ordering rules (issue 30, section 2), on the simulated GPU.

Each test drives a hazard the simulation now shows: a compute-stream wait orders device work only,
so a host read of a gradient needs a host wait; a parameter's copy back to the device is only safe
to read once the stream that reads it waited for it, whoever reads it. Held copy streams make each
missing wait bite every time rather than when a thread happens to be late.
"""

from __future__ import annotations


import pytest
import torch
from exact import assert_state_equal
from fake_cudart import use_simulated_runtime
from lit_models import cpu_trainer
from optimizer_models import (
    HOST_KERNEL,
    OPTIMIZERS,
    assert_given_back,
    lit_tiny_class,
    regression_batches,
    regression_loader,
    tiny_net,
)
from torch import nn

import lightmem.model_state.offloader as optimizer_offload
from lightmem import LightMem, offload_optimizer
from lightmem.model_state.landing import GradientLanding
from lightmem.model_state.params_back import ParamsBack
from lightmem.testing.simulated import SimulatedAsyncTransport

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _train(make_model, offload=None, steps=3, optimizer="adamw-decay", width=8, between_steps=None, clip=None):
    """``steps`` plain steps; ``between_steps(model, step)`` runs after each ``optimizer.step()``.
    Without ``offload`` (the reference) the optimizer is built with the kernel lightmem steps it with."""
    torch.manual_seed(0)
    model = make_model()
    extra = [param for name, param in getattr(model, "extra_params", {}).items()]
    params = [*model.parameters(), *extra]
    opt = OPTIMIZERS[optimizer](params, **({} if offload is not None else HOST_KERNEL))
    handle = offload(model, opt) if offload is not None else None
    torch.manual_seed(2)
    for step, (inputs, targets) in enumerate(regression_batches(steps, width)):
        loss = model.loss(inputs, targets) if hasattr(model, "loss") else nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], clip)
        opt.step()
        opt.zero_grad()
        if between_steps is not None:
            between_steps(model, step)
    return model, opt, handle


def _simulated(hold_to_host=False, hold_to_device=False, **kwargs):
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, **kwargs)
    if hold_to_host:
        transport.hold_copies_to_host()
    if hold_to_device:
        transport.hold_copies_to_device()
    return transport


def _on(transport, **kwargs):
    return lambda model, opt: offload_optimizer(model, opt, devices=("cpu",), transport=transport, **kwargs)


def _assert_exact(make_model, transport, **kwargs):
    model_a, opt_a, _ = _train(make_model, **kwargs)
    model_b, opt_b, handle = _train(make_model, _on(transport, **kwargs.pop("offload_kwargs", {})), **kwargs)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert transport.host_races == 0
    transport.close()


# -- 1. every host read of a gradient comes after its copy to host ----------------------------------


@pytest.mark.parametrize("bound", [0, 16 * 8 * 4 - 1])
def test_the_host_step_reads_every_gradient_after_its_copy_landed(bound):
    # Past the bound the compute stream waits for the oldest copy: that lets its device gradient
    # go, and protects no host read. With bound 0 every gradient is retired so; with the largest
    # one's size less one, the first gradient of backward is alone over the bound (an LM head).
    transport = _simulated(hold_to_host=True)
    model_a, opt_a, _ = _train(tiny_net, clip=0.5)
    model_b, opt_b, handle = _train(tiny_net, _on(transport, max_grad_inflight_bytes=bound), clip=0.5)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    transport.close()


# -- 2. every read of a parameter after a step comes after its copy back ----------------------------


class _Encoder(nn.Module):
    """nn.TransformerEncoderLayer: its MultiheadAttention reads out_proj.weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.layer(x.unsqueeze(1)).squeeze(1))


class _Pruned(nn.Module):
    """A pruning pre-hook (registered before lightmem's) reads weight_orig to make the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()
        torch.nn.utils.prune.l1_unstructured(self.net[0], "weight", amount=0.25)

    def forward(self, x):
        return self.net(x)


class _Symmetric(nn.Module):
    def forward(self, weight):
        return weight.triu() + weight.triu(1).transpose(0, 1)


class _Parametrized(nn.Module):
    """The weight is computed from parametrizations.weight.original, owned by a module never called."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(8, 8)
        torch.nn.utils.parametrize.register_parametrization(self.square, "weight", _Symmetric())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.square(x)))


class _LearnedLossScale(nn.Module):
    """A loss with a learnable parameter that belongs to no module of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()
        self.extra_params = {"log_scale": nn.Parameter(torch.zeros(()))}

    def forward(self, x):
        return self.net(x)

    def loss(self, inputs, targets):
        scale = self.extra_params["log_scale"]
        return nn.functional.mse_loss(self(inputs), targets) * scale.exp() + scale


@pytest.mark.parametrize("make_model", [_Encoder, _Pruned, _Parametrized, _LearnedLossScale])
def test_parameters_read_other_than_by_their_own_module_see_the_step(make_model):
    _assert_exact(make_model, _simulated(hold_to_device=True))


def _gpt2():
    transformers = pytest.importorskip("transformers")

    class _GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=8)
            self.lm = transformers.GPT2LMHeadModel(config)

        def forward(self, x):
            ids = (x.abs() * 4).long().clamp(max=31)
            return self.lm(input_ids=ids).logits.float().mean(dim=(1, 2)).unsqueeze(1)

    return _GPT2()


def _bert():
    transformers = pytest.importorskip("transformers")

    class _Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.BertConfig(
                hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=32,
                max_position_embeddings=16,
            )  # fmt: skip
            self.encoder = transformers.BertModel(config)

        def forward(self, x):
            ids = (x.abs() * 4).long().clamp(max=31)
            return self.encoder(input_ids=ids).last_hidden_state.mean(dim=(1, 2)).unsqueeze(1)

    return _Bert()


@pytest.mark.parametrize("make_model", [_gpt2, _bert])
def test_transformers_models_from_default_configs_are_exact_with_held_copies(make_model):
    _assert_exact(make_model, _simulated(hold_to_device=True, hold_to_host=True))


def test_weight_averaging_between_steps_reads_the_stepped_parameters():
    averaged = {}

    def average(model, step):
        if step == 0:
            averaged[id(model)] = torch.optim.swa_utils.AveragedModel(model)
        averaged[id(model)].update_parameters(model)

    transport = _simulated(hold_to_device=True)
    model_a, opt_a, _ = _train(tiny_net, between_steps=average)
    model_b, opt_b, handle = _train(tiny_net, _on(transport), between_steps=average)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert_state_equal(averaged[id(model_a)], averaged[id(model_b)])
    transport.close()


class _ScaledEncoder(_Encoder):
    """The encoder and a parameter its root module reads in its own forward, outside every
    submodule (tests/gpu/test_cuda_rules_cuda.py's model, small)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return super().forward(x) * self.log_scale.exp()


def test_weight_averaging_and_load_state_dict_between_steps_of_a_model_whose_root_reads_a_parameter():
    # The H100 run of the GPU test differed in log_scale (the first key of the state dict): its
    # reference stepped the host copies taken before the load and wrote them over the loaded
    # weights. Loaded weights are what the next step starts from, here as on a plain optimizer.
    torch.manual_seed(5)
    loaded = _ScaledEncoder().state_dict()
    averaged = {}

    def between(model, step):
        averaged.setdefault(id(model), torch.optim.swa_utils.AveragedModel(model)).update_parameters(model)
        if step == 1:
            model.load_state_dict(loaded)

    transport = _simulated(hold_to_device=True, hold_to_host=True)
    model_a, opt_a, _ = _train(_ScaledEncoder, between_steps=between)
    model_b, opt_b, handle = _train(_ScaledEncoder, _on(transport), between_steps=between)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert_state_equal(averaged[id(model_a)], averaged[id(model_b)])
    assert torch.equal(model_b.log_scale, model_a.log_scale) and model_b.log_scale.item() != 0.0
    transport.close()


def test_a_step_post_hook_registered_before_offload_sees_the_stepped_parameters():
    # A user's hook on the optimizer (weight averaging, logging the weights), registered before
    # lightmem's: lightmem's copy back runs first, so the hook reads the stepped values.
    def run(offload):
        torch.manual_seed(0)
        model = tiny_net()
        opt = OPTIMIZERS["sgd-momentum"](model.parameters(), **({} if offload else HOST_KERNEL))
        seen = []
        opt.register_step_post_hook(lambda *_: seen.append(model[0].weight.detach().clone()))
        transport = _simulated(hold_to_device=True)
        handle = offload_optimizer(model, opt, devices=("cpu",), transport=transport) if offload else None
        for inputs, targets in regression_batches(3):
            nn.functional.mse_loss(model(inputs), targets).backward()
            opt.step()
            opt.zero_grad()
        if handle is not None:
            handle.close()
        transport.close()
        return seen

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_load_state_dict_after_a_step_is_what_the_model_and_its_host_copies_hold():
    torch.manual_seed(5)
    loaded = tiny_net().state_dict()

    def load(model, step):
        if step == 1:
            model.load_state_dict(loaded)

    transport = _simulated(hold_to_device=True)
    model_a, opt_a, _ = _train(tiny_net, between_steps=load)
    model_b, opt_b, handle = _train(tiny_net, _on(transport), between_steps=load)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    transport.close()


def test_a_second_stream_that_waits_for_the_current_one_is_ordered_after_the_copies_back():
    # CUDA's rule for work on a stream of the user's: wait for the current stream first
    # (``side.wait_stream(torch.cuda.current_stream())``). That orders it after the copies back,
    # since the step made the current stream wait for them.
    transport = _simulated(hold_to_device=True)
    ordered = []

    def on_side_stream(model, step):
        current = transport.current_stream()
        with transport.stream(1) as side:
            transport.wait(side, transport.record(current))
            ordered.append(transport.ordered_after_copies(side))

    model_a, opt_a, _ = _train(tiny_net)
    model_b, opt_b, handle = _train(tiny_net, _on(transport), between_steps=on_side_stream)
    assert ordered == [True, True, True]
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    transport.close()


def _lit_encoder(package, **kwargs):
    torch.manual_seed(0)
    module = lit_tiny_class(package)(**kwargs)
    module.net = _Encoder()  # attention reading a child's weight, in a Lightning fit
    return module


def test_a_lightning_fit_of_an_attention_model_with_held_copies_is_exact(lightning_package, monkeypatch):
    transport = _simulated(hold_to_device=True, hold_to_host=True)
    monkeypatch.setattr(optimizer_offload, "default_transport", lambda devices: transport)
    settings = dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5, package=lightning_package)
    reference = _lit_encoder(lightning_package, kernel=HOST_KERNEL)
    trainer_a = cpu_trainer([], **settings)
    trainer_a.fit(reference, regression_loader())
    offloaded = _lit_encoder(lightning_package)
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])
    trainer_b = cpu_trainer([callback], **settings)
    trainer_b.fit(offloaded, regression_loader())
    assert_given_back(reference, offloaded, trainer_a.optimizers[0], trainer_b.optimizers[0])
    transport.close()


def _two_steps_without_backward_between(transport):
    """Two steps on the same gradients: nothing between them waits for the first step's copies back
    (a backward would: its gradient copies follow compute, which waited for them)."""
    torch.manual_seed(0)
    model = tiny_net()
    opt = OPTIMIZERS["sgd-momentum"](model.parameters())
    handle = offload_optimizer(model, opt, devices=("cpu",), transport=transport)
    nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
    opt.step()
    opt.step()  # rewrites the host copies the first step's copies back read
    handle.close()
    transport.release_copies_to_device()
    transport.synchronize()


def test_a_step_rewrites_the_host_copies_only_after_the_last_copies_back_ran():
    transport = _simulated(hold_to_device=True)
    _two_steps_without_backward_between(transport)
    assert transport.host_races == 0
    transport.close()


def test_sabotage_a_step_that_does_not_wait_for_the_copies_back_is_detected(monkeypatch):
    monkeypatch.setattr(ParamsBack, "host_wait", lambda self: None)
    transport = _simulated(hold_to_device=True)
    _two_steps_without_backward_between(transport)
    assert transport.host_races > 0
    transport.close()


def test_an_overlapped_step_waits_for_the_copies_back_before_rewriting_the_host_copies():
    transport = _simulated(hold_to_device=True)
    model_a, opt_a, _ = _train(tiny_net)
    model_b, opt_b, handle = _train(tiny_net, _on(transport, overlap_step=True))
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert transport.host_races == 0
    transport.close()


# -- 4. page-locked host memory is what is counted ------------------------------------------------


def test_page_locked_host_memory_is_exactly_what_the_stats_count_and_is_given_back(monkeypatch):
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=0.0, page_locking=True)
    use_simulated_runtime(monkeypatch, transport)
    model_a, opt_a, _ = _train(tiny_net, steps=2)
    model_b, opt_b, handle = _train(tiny_net, _on(transport), steps=2)
    stats = handle.stats
    # 193 fp32 parameters in six tensors, each on a 64-byte line: 512 + 5 x 64 bytes, once for the
    # host copies and once for the gradients, each registered at that exact size.
    assert stats.host_param_bytes == stats.host_grad_bytes == 832
    assert transport.runtime.page_locked_bytes == 2 * 832
    assert transport.pinned_stats()["reserved"] == 0  # nothing from torch's rounding, caching allocator
    assert transport.pageable_copies == 0  # every copy ran asynchronously
    handle.close()
    assert transport.runtime.page_locked_bytes == 0
    assert_given_back(model_a, model_b, opt_a, opt_b)
    transport.close()


# -- 5. events are not a leak ----------------------------------------------------------------------


def test_events_do_not_grow_with_the_steps():
    transport = _simulated()
    torch.manual_seed(0)
    model = tiny_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    with offload_optimizer(model, opt, devices=("cpu",), transport=transport):
        for step in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            counts.append(transport.live_events)
    assert counts[2:] == [counts[2]] * 4
    assert counts[-1] <= 6  # one copy event per parameter at most (six parameters)
    transport.close()


class _FakeCudaEvent:
    """``torch.cuda.Event``: counted while alive; completes when the fake GPU passes it."""

    live = 0

    def __init__(self, enable_timing: bool = False) -> None:
        type(self).live += 1
        self.completed = False

    def __del__(self) -> None:
        type(self).live -= 1

    def record(self, stream) -> None:
        stream.recorded.append(self)

    def query(self) -> bool:
        return self.completed

    def elapsed_time(self, end) -> float:
        return 2.0  # milliseconds


class _FakeCudaStream:
    device = 0

    def __init__(self) -> None:
        self.recorded = []

    def wait_event(self, event) -> None:
        pass

    def run_all(self) -> None:
        for event in self.recorded:
            event.completed = True
        self.recorded = []


def test_cuda_transport_keeps_a_bounded_number_of_timing_events_when_nobody_reads_them(monkeypatch):
    from lightmem.transfer.transport import CudaTransport

    compute = _FakeCudaStream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(CudaTransport, "capturing", staticmethod(lambda: False))
    transport = CudaTransport()
    copy_event = _FakeCudaEvent()  # a copy that has not finished: each wait is timed
    before = _FakeCudaEvent.live
    for _ in range(1000):  # two waits per parameter per step, and nothing calls waited_s()
        transport.wait(compute, copy_event)
    assert _FakeCudaEvent.live - before == 2 * CudaTransport.MAX_TIMED_WAITS
    assert transport.untimed_waits == 1000 - CudaTransport.MAX_TIMED_WAITS
    compute.run_all()  # the GPU passes every wait
    transport.wait(compute, copy_event)  # reads the finished timings back, times this one
    assert _FakeCudaEvent.live - before == 2
    assert transport.waited_s() == pytest.approx(CudaTransport.MAX_TIMED_WAITS * 2.0 / 1e3, abs=1e-12)


# -- 6. under Lightning the closure's forward is queued before the host waits for anything ---------


def test_lightning_closure_forward_is_queued_before_the_host_waits_for_the_copies_back(monkeypatch):
    transport = _simulated(hold_to_device=True)
    monkeypatch.setattr(optimizer_offload, "default_transport", lambda devices: transport)
    from optimizer_models import LitTiny

    waits_at_training_step = []

    class Watching(LitTiny):
        def training_step(self, batch, batch_idx):
            waits_at_training_step.append(transport.host_waits)
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            transport.host_waits = 0

    torch.manual_seed(0)
    module = Watching()
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])
    cpu_trainer([callback], max_steps=3).fit(module, regression_loader())
    assert waits_at_training_step == [0, 0, 0]
    transport.release_copies_to_device()
    transport.close()


# -- 7. reentrant checkpointing lands the gradients once, at the end of backward --------------------


class _Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = x.requires_grad_() if not x.requires_grad else x
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return self.head(x)


@pytest.mark.parametrize("head_first", [True, False])
def test_reentrant_checkpointing_lands_gradients_once_per_backward(head_first, monkeypatch):
    landings = []
    original = GradientLanding.land_all

    def counting(self):
        landings.append(len(self._landing))
        original(self)

    monkeypatch.setattr(GradientLanding, "land_all", counting)

    def make():
        model = _Reentrant()
        if not head_first:  # the first final gradient of backward is inside a nested backward
            model.head.requires_grad_(False)
        return model

    transport = _simulated()
    model_a, opt_a, _ = _train(make, steps=2)
    model_b, opt_b, handle = _train(make, _on(transport), steps=2)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    gradients = 6 + (2 if head_first else 0)
    assert landings == [gradients, gradients]  # one landing per backward, holding every gradient
    transport.close()


# -- 9. frozen parameters and gradients kept across steps ------------------------------------------


def test_a_frozen_parameter_in_the_optimizer_is_supported():
    def make():
        model = tiny_net()
        model[0].bias.requires_grad_(False)
        return model

    _assert_exact(make, _simulated())

