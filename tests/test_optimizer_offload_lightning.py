"""LightMem(offload_optimizer=True) in a real Trainer on CPU: the whole training state is bitwise
what the same fit gives without lightmem (weights, buffers, optimizer state, RNG; the optimizer
constructed there with the fused kernel lightmem runs on the host), checkpoints cross over both
ways, and what cannot work is refused by name."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from exact import assert_same, assert_state_equal
from lit_models import cpu_trainer
from optimizer_models import (
    HOST_KERNEL,
    LitTiny,
    assert_given_back,
    assert_same_fit,
    fit_tiny,
    lit_tiny_class,
    offloading_optimizer,
    regression_loader,
    run_two_process_script,
)

from lightmem import LightMem
from lightmem.config import LIGHTMEM, OptimizerOffloadSettings
from lightmem.model_state.trainer_optimizers import offload_trainer_optimizers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")


def _offloading():
    """The callback these tests train with: model-state offload alone, on CPU."""
    return LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])


def _fit_with(callback, module_kwargs=None, ckpt_path=None, **trainer_kwargs):
    """Without a callback, the reference: its optimizer constructed with the kernel lightmem runs."""
    pl.seed_everything(0, verbose=False)
    module = LitTiny(**{**({} if callback else {"kernel": HOST_KERNEL}), **(module_kwargs or {})})
    trainer = cpu_trainer([callback] if callback else [], **trainer_kwargs)
    trainer.fit(module, regression_loader(), ckpt_path=ckpt_path)
    return module, trainer, torch.get_rng_state()


def _fit(offload: bool, module_kwargs=None, **trainer_kwargs):
    return _fit_with(_offloading() if offload else None, module_kwargs, **trainer_kwargs)


def _assert_same_run(expected, actual):
    (module_a, trainer_a, rng_a), (module_b, trainer_b, rng_b) = expected, actual
    assert_given_back(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])
    schedulers_a = [config.scheduler.state_dict() for config in trainer_a.lr_scheduler_configs]
    schedulers_b = [config.scheduler.state_dict() for config in trainer_b.lr_scheduler_configs]
    assert_same(schedulers_a, schedulers_b, "LR schedulers")
    assert_same(rng_a, rng_b, "RNG state")


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay"])
def test_fit_with_accumulation_clipping_and_scheduler_is_bitwise_equal_without_lightmem(optimizer, optimizer_offload_transport):
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    expected = _fit(False, {"optimizer": optimizer}, **settings)
    actual = _fit(True, {"optimizer": optimizer}, **settings)
    _assert_same_run(expected, actual)


@pytest.mark.parametrize(
    ("module_kwargs", "trainer_kwargs"),
    [
        ({}, {"precision": "bf16-mixed"}),
        ({}, {"precision": "bf16-true"}),
        ({"manual": True}, {}),
        ({}, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    ],
    ids=["bf16-mixed", "bf16-true", "manual-optimization", "clip-by-value"],
)
def test_precisions_manual_optimization_and_clipping_by_value_are_bitwise_equal(module_kwargs, trainer_kwargs):
    expected = _fit(False, module_kwargs, **trainer_kwargs)
    actual = _fit(True, module_kwargs, **trainer_kwargs)
    _assert_same_run(expected, actual)


def test_the_fit_really_ran_on_the_host_and_says_so(caplog):
    callback = _offloading()
    pl.seed_everything(0, verbose=False)
    module = LitTiny()
    with caplog.at_level("INFO"):
        cpu_trainer([callback], accumulate_grad_batches=2).fit(module, regression_loader())
    (stats,) = callback.optimizer_offload_stats
    assert (stats.steps, stats.grad_bytes_out, stats.param_bytes_in) == (4, 2 * 193 * 4, 193 * 4)
    assert stats.host_kernel == "fused"
    assert (
        "lightmem: on: optimizer offload (gradients, optimizer state and step on the host; AdamW step: "
        "fused, lightmem's choice: foreach/fused were unset; host step overlapped with backward)." in caplog.text
    )
    # After fit the optimizer steps the module's own parameters again.
    optimizer = module.trainer.optimizers[0]
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in module.parameters()]


def test_without_cuda_the_default_devices_leave_it_off_and_say_why(caplog):
    callback = LightMem(offload=False, offload_optimizer=True, metrics=["host"])
    with caplog.at_level("INFO"):
        _fit_with(callback)
    assert "optimizer offload (the model is on cpu, not a device type in LightMem(offload_devices=...))" in caplog.text
    assert callback.optimizer_offload_stats == []


def test_a_fit_without_an_optimizer_trains_and_the_line_says_nothing_is_offloaded(lightning_package, caplog):
    class NoOptimizer(lit_tiny_class(lightning_package)):
        def configure_optimizers(self):
            return None

    callback = offloading_optimizer()
    with caplog.at_level("INFO"):
        _, trainer, _ = fit_tiny(callback, lightning_package, module_class=NoOptimizer)
    assert trainer.global_step == 4
    assert callback.optimizer_offload_stats == []
    line = (
        "lightmem: on: nothing. Off: optimizer offload (configure_optimizers returned None: the fit has no "
        "optimizer, nothing to offload)."
    )
    assert caplog.text.count(line) == 1


def test_the_modules_zero_grad_receives_the_callers_arguments(lightning_package):
    class RecordsZeroGrad(lit_tiny_class(lightning_package)):
        calls = []

        def zero_grad(self, *args, **kwargs):
            self.calls.append((args, kwargs))
            super().zero_grad(*args, **kwargs)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 0:
                self.zero_grad(set_to_none=False)

    fit_tiny(offloading_optimizer(), lightning_package, module_class=RecordsZeroGrad)
    # Lightning's own call as a stage starts, then the module's.
    assert RecordsZeroGrad.calls == [((), {}), ((), {"set_to_none": False})]


@pytest.mark.parametrize(("first", "second"), [(True, False), (False, True)], ids=["offloaded-to-plain", "plain-to-offloaded"])
def test_a_checkpoint_resumes_across_the_option_both_ways(tmp_path, first, second):
    def lightmem(on):
        return _offloading() if on else None

    def half_then_resume(first_on, second_on, name):
        # One kernel throughout, chosen explicitly: what crosses over is the checkpoint.
        _, trainer, _ = _fit_with(lightmem(first_on), {"kernel": HOST_KERNEL}, max_steps=2)
        path = str(tmp_path / name)
        trainer.save_checkpoint(path)
        return _fit_with(lightmem(second_on), {"kernel": HOST_KERNEL}, ckpt_path=path, max_steps=4)

    # Lightning does not restore the RNG, so the reference resumes too (without lightmem at all).
    module_a, trainer_a, _ = half_then_resume(False, False, "plain.ckpt")
    module_b, trainer_b, _ = half_then_resume(first, second, "crossed.ckpt")
    assert_state_equal(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])


def test_a_resumed_fit_loads_the_optimizer_state_on_the_host_without_a_trip_to_the_device(tmp_path, monkeypatch):
    # Lightning moves a restored optimizer state to the root device; offloaded, it stays on the host.
    moved = []
    import pytorch_lightning.strategies.strategy as strategy_module

    original = strategy_module._optimizer_to_device
    monkeypatch.setattr(strategy_module, "_optimizer_to_device", lambda *args: moved.append(args) or original(*args))
    _, trainer, _ = _fit_with(_offloading(), {"kernel": HOST_KERNEL}, max_steps=2)
    path = str(tmp_path / "half.ckpt")
    trainer.save_checkpoint(path)
    _fit_with(_offloading(), {"kernel": HOST_KERNEL}, ckpt_path=path, max_steps=4)
    assert moved == []
    _fit_with(None, {"kernel": HOST_KERNEL}, ckpt_path=path, max_steps=4)  # without lightmem it does move
    assert len(moved) == 1


def _trainer_with(strategy, scaler=None):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return SimpleNamespace(strategy=strategy, precision_plugin=SimpleNamespace(scaler=scaler), optimizers=[optimizer])


_SETTINGS = OptimizerOffloadSettings.parse(devices=("cpu",), spelling=LIGHTMEM)


def test_a_subclass_of_fsdp_is_pointed_to_fsdps_own_cpu_offload(lightning_package):
    class ShardedForUs(lightning_package.strategies.FSDPStrategy):
        pass

    with pytest.raises(ValueError) as error:
        offload_trainer_optimizers(_trainer_with(ShardedForUs()), _SETTINGS)
    assert str(error.value) == (
        "LightMem(offload_optimizer=...): not available under ShardedForUs: FSDP shards the optimizer "
        "state itself and has its own CPU offload: use FSDPStrategy(cpu_offload=True) (FSDP2: "
        "CPUOffloadPolicy) instead"
    )


def test_deepspeed_is_pointed_to_its_own_offload_though_it_derives_from_ddp(lightning_package):
    strategy = object.__new__(lightning_package.strategies.DeepSpeedStrategy)  # constructing it needs deepspeed
    with pytest.raises(ValueError) as error:
        offload_trainer_optimizers(_trainer_with(strategy), _SETTINGS)
    assert str(error.value) == (
        "LightMem(offload_optimizer=...): not available under DeepSpeedStrategy: DeepSpeed has its own: use "
        "DeepSpeedStrategy(offload_optimizer=True)"
    )


def test_a_strategy_of_no_lightning_kind_is_refused_naming_what_works():
    with pytest.raises(ValueError) as error:
        offload_trainer_optimizers(_trainer_with(type("OwnStrategy", (), {})()), _SETTINGS)
    assert str(error.value) == (
        "LightMem(offload_optimizer=...): works with one device per process, unsharded (SingleDeviceStrategy, "
        "DDPStrategy or a subclass of either); got OwnStrategy"
    )


def test_ddp_with_gradients_as_bucket_views_is_refused(lightning_package):
    class OwnDDP(lightning_package.strategies.DDPStrategy):
        pass

    strategy = OwnDDP()
    strategy.model = SimpleNamespace(gradient_as_bucket_view=True)
    with pytest.raises(ValueError) as error:
        offload_trainer_optimizers(_trainer_with(strategy), _SETTINGS)
    assert str(error.value) == (
        "LightMem(offload_optimizer=...): DDP's gradient_as_bucket_view=True makes gradients views of "
        "DDP's buckets, which must stay on the device; use DDPStrategy(gradient_as_bucket_view=False)"
    )


def test_a_subclass_of_single_device_strategy_trains_bitwise_as_without_lightmem(lightning_package):
    class TestPlugin(lightning_package.strategies.SingleDeviceStrategy):  # as Lightning's own tests name one
        pass

    callback = offloading_optimizer()
    expected = fit_tiny(None, lightning_package, strategy=TestPlugin(device="cpu"))
    actual = fit_tiny(callback, lightning_package, strategy=TestPlugin(device="cpu"))
    assert_same_fit(expected, actual)
    assert callback.optimizer_offload_stats[0].steps == 4


@pytest.fixture
def one_process_ddp():
    """DDP fits in this process (world size 1, gloo); afterwards the process group, the environment
    variables and the thread count Lightning set up for them are undone."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


def test_a_subclass_of_ddp_strategy_trains_bitwise_as_without_lightmem(lightning_package, one_process_ddp):
    class OwnDDP(lightning_package.strategies.DDPStrategy):
        pass

    callback = offloading_optimizer()
    expected = fit_tiny(None, lightning_package, strategy=OwnDDP())
    actual = fit_tiny(callback, lightning_package, strategy=OwnDDP())
    assert_same_fit(expected, actual)
    assert callback.optimizer_offload_stats[0].steps == 4


def test_ddp_each_rank_steps_on_the_averaged_gradients_bitwise_like_ddp_without_lightmem(tmp_path):
    # 2 CPU processes (gloo), one launch of tests/optimizer_ddp_script.py: AdamW, accumulation 2
    # (no_sync micro-batches), clipping by norm, StepLR; the same fit without lightmem as reference.
    report = run_two_process_script("optimizer_ddp_script.py", tmp_path)
    assert report == {"equal_per_rank": [True, True], "steps_per_rank": [3, 3], "ranks_agree": True}


def test_a_gradient_scaler_is_refused():
    with pytest.raises(ValueError) as error:
        offload_trainer_optimizers(_trainer_with(pl.strategies.SingleDeviceStrategy("cpu"), scaler=object()), _SETTINGS)
    assert str(error.value) == (
        "LightMem(offload_optimizer=...): a gradient scaler (precision='16-mixed') unscales and checks "
        "gradients per device and cannot run on host gradients; use precision='bf16-mixed', "
        "'bf16-true' or '32-true'"
    )


def test_the_flag_takes_only_a_bool():
    with pytest.raises(ValueError) as error:
        LightMem(offload_optimizer="yes")
    assert str(error.value) == "LightMem(offload_optimizer=...): expected True or False; got 'yes'"


def test_metrics_and_summary_report_host_bytes_and_traffic_of_each_step():
    from test_callback_metrics import MemoryLogger

    from lightmem.metrics.names import METRICS
    from lightmem.metrics.tensorboard import custom_scalars_layout

    logger = MemoryLogger()
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1)
    pl.seed_everything(0, verbose=False)
    cpu_trainer([callback], logger=logger, accumulate_grad_batches=2).fit(LitTiny(optimizer="adam"), regression_loader())
    rows = [metrics for _, metrics in logger.metrics if any(k.startswith("lightmem/memory/") for k in metrics)]
    assert len(rows) == 4
    gib = float(1024**3)
    optimizer_keys = {m.key for m in METRICS if "/optimizer/" in m.key}
    for metrics in rows:
        assert set(metrics) == optimizer_keys
        # Host copies and gradients in arenas: six tensors on 64-byte lines, 832 bytes for 772 of values.
        assert metrics["lightmem/memory/optimizer/host_params_GiB"] == 832 / gib
        assert metrics["lightmem/memory/optimizer/host_grads_GiB"] == 2 * 832 / gib  # + staging
        assert metrics["lightmem/memory/optimizer/host_state_GiB"] == (2 * 193 * 4 + 6 * 4) / gib
        assert metrics["lightmem/memory/optimizer/grads_out_GiB"] == 2 * 193 * 4 / gib
        assert metrics["lightmem/memory/optimizer/params_in_GiB"] == 193 * 4 / gib
    charts = custom_scalars_layout(rows[0])["lightmem memory"]
    assert set(charts) == {
        "Optimizer offload host memory (GiB)", "Optimizer offload traffic (GiB)", "Optimizer offload waits (ms)",
        "Gradient norm, global 2-norm",
    }  # fmt: skip
    summary = callback.summary()  # reported only where a progress bar shows; this Trainer has none
    assert "optimizer offload: gradients to host per step" in summary
    assert "optimizer offload: host bytes held (peak)" in summary


def test_composes_with_activation_offload_and_checkpointing():
    from lit_models import LitGPT, token_loader

    class FusedLitGPT(LitGPT):  # the reference: the kernel lightmem runs on the host
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, **HOST_KERNEL)

    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        module = LitGPT() if callbacks else FusedLitGPT()
        trainer = cpu_trainer(callbacks, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0)
        trainer.fit(module, token_loader(batches=6))
        return module, trainer

    expected_module, expected_trainer = fit([])
    everything = LightMem(
        offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"], offload_optimizer=True, metrics=[]
    )
    module, trainer = fit([everything])
    assert_given_back(expected_module, module, expected_trainer.optimizers[0], trainer.optimizers[0])
    assert everything.optimizer_offload_stats[0].steps == 3


def test_the_out_of_memory_advice_names_the_flag_when_model_state_fills_the_device():
    from lightmem.oom import advice

    lines = advice(
        offload=True, offload_min_bytes=1, checkpointed_blocks=0, repeated_block=None,
        breakdown={"parameters": 800, "gradients": 800, "optimizer_state": 1600, "allocated": 3300},
    )  # fmt: skip
    assert lines[0] == (
        "Parameters, gradients and optimizer state take most of the device: activation offload or "
        "checkpointing cannot fix that. Keep only the parameters on the device with "
        "LightMem(offload_optimizer=True) (gradients, optimizer state and step on the host), or use "
        "bf16 weights, an optimizer with less state, or sharding (FSDP / DeepSpeed ZeRO)."
    )
