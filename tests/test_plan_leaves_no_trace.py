"""``LightMem(plan="auto")`` in every Lightning fit (issue 56): the planner's dry run runs the user's
code on a stand-in, so a fit with planning equals the fit without it — parameters, buffers,
optimizer and scheduler state, every plain attribute of every module, logged metrics, every RNG —
and no fake tensor reaches a user-visible object; with a budget that makes the plan checkpoint,
training is bitwise the fit with those blocks checkpointed by hand."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from exact import assert_same
from idiom_models import IDIOMS, idiom_class, loader
from lit_models import cpu_trainer
from torch._subclasses.fake_tensor import FakeTensor

from lightmem import LightMem, apply_checkpointing

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOMY = "1GiB"
"""A budget every idiom fits in: the plan changes nothing."""
TIGHT = {
    "automatic": 3_700_000, "dict": 3_700_000, "none": 3_700_000, "dataloader_iter": 3_700_000,
    "lbfgs": 8_000_000, "manual_one": 4_000_000, "manual_two": 3_300_000, "reads_values": 3_700_000,
}  # fmt: skip
"""Budgets between each idiom's predicted peak without lightmem and with every block checkpointed
(automatic: 4.52 MB and 2.80 MB; LBFGS: 8.57 MB and 7.42 MB; manual with one optimizer: 4.59 MB
and 3.48 MB; with two: 3.96 MB and 2.50 MB): the plan checkpoints some blocks (asserted)."""

_NOT_COMPARED = {
    "_parameters", "_buffers", "_modules", "_trainer", "_fabric", "_forward_hooks", "_forward_pre_hooks",
    "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "forward",  # a block checkpointed by hand keeps its wrapper; lightmem's leaves with the fit
}  # fmt: skip


@dataclass
class Fit:
    module: Any
    trainer: Any
    rng: tuple[Any, ...]


def fit(package, idiom: str, callbacks=(), checkpoint=None) -> Fit:
    package.seed_everything(0, verbose=False)
    module = idiom_class(idiom, package)()
    if checkpoint:
        apply_checkpointing(module, list(checkpoint))
    trainer = cpu_trainer(callbacks, package, max_steps=3)
    trainer.fit(module, loader())
    return Fit(module, trainer, (torch.get_rng_state(), torch.from_numpy(np.random.get_state()[1].copy()), random.getstate()))


def assert_plain_equal(expected: Any, actual: Any, where: str, seen: set[int]) -> None:
    """Two runs' user-visible values are equal, and hold no fake tensor."""
    assert not isinstance(actual, FakeTensor), f"{where} holds a fake tensor"
    if id(expected) in seen or isinstance(expected, torch.nn.Module):
        return  # a module is compared as a module of the tree
    seen.add(id(expected))
    if isinstance(expected, torch.Tensor):
        assert_same(expected, actual, where)
    elif isinstance(expected, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        assert type(expected) is type(actual), where
        assert_same(expected.state_dict(), actual.state_dict(), where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(expected) == list(actual), f"{where}: keys differ"
        for key in expected:
            assert_plain_equal(expected[key], actual[key], f"{where}[{key!r}]", seen)
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(actual) and len(expected) == len(actual), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, actual)):
            assert_plain_equal(a, b, f"{where}[{i}]", seen)
    elif isinstance(expected, (int, float, str, bool, type(None))):
        assert expected == actual, f"{where}: {expected!r} vs {actual!r}"


def assert_fits_equal(plain: Fit, planned: Fit) -> None:
    assert_same(plain.module.state_dict(), planned.module.state_dict(), "state_dict")
    for i, (a, b) in enumerate(zip(plain.trainer.optimizers, planned.trainer.optimizers, strict=True)):
        assert_same(a.state_dict(), b.state_dict(), f"optimizer {i}")
    for i, (a, b) in enumerate(zip(plain.trainer.lr_scheduler_configs, planned.trainer.lr_scheduler_configs, strict=True)):
        assert_same(a.scheduler.state_dict(), b.scheduler.state_dict(), f"scheduler {i}")
    for (name, a), (_, b) in zip(plain.module.named_modules(), planned.module.named_modules(), strict=True):
        for key, value in vars(a).items():
            if key not in _NOT_COMPARED:
                assert_plain_equal(value, vars(b)[key], f"{name or 'module'}.{key}", set())
    # The module's own optimizer and scheduler are the ones the Trainer steps.
    for run in (plain, planned):
        if hasattr(run.module, "my_opt"):
            assert run.trainer.optimizers[0] is run.module.my_opt
        if hasattr(run.module, "sched"):
            assert run.trainer.lr_scheduler_configs[0].scheduler is run.module.sched
    assert_same(dict(plain.trainer.callback_metrics), dict(planned.trainer.callback_metrics), "logged metrics")
    assert_same(plain.rng[0], planned.rng[0], "torch RNG")
    assert_same(plain.rng[1], planned.rng[1], "NumPy RNG")
    assert plain.rng[2] == planned.rng[2], "random's RNG"


@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_a_fit_that_plans_nothing_equals_the_fit_without_lightmem(lightning_package, idiom):
    plain = fit(lightning_package, idiom)
    callback = LightMem(plan="auto", device_budget=ROOMY)
    planned = fit(lightning_package, idiom, [callback])
    assert callback.chosen_plan is not None and callback.chosen_plan.checkpoint == []
    assert_fits_equal(plain, planned)


@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_a_fit_whose_plan_checkpoints_equals_the_fit_checkpointed_by_hand(lightning_package, idiom):
    callback = LightMem(plan="auto", device_budget=TIGHT[idiom])
    planned = fit(lightning_package, idiom, [callback])
    chosen = callback.chosen_plan.checkpoint
    assert chosen and all(name.startswith("model.blocks.") for name in chosen), chosen
    by_hand = fit(lightning_package, idiom, checkpoint=chosen)
    assert_fits_equal(by_hand, planned)


class _ReadsNumPy:
    """A step the dry run cannot trace (NumPy reads values fake tensors do not have)."""

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        self.draws.append(float(tokens.cpu().numpy().mean()))
        return self.loss(tokens)


class _RaisesAtFirstBatch:
    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            raise RuntimeError("labels out of range in batch 0")
        return super().training_step(batch, batch_idx)


def _variant(package, mixin, idiom="automatic"):
    return type(mixin.__name__.lstrip("_"), (mixin, idiom_class(idiom, package)), {})


def test_a_step_the_dry_run_cannot_trace_trains_as_written_on_a_cpu_saying_why(lightning_package, recwarn):
    module_class = _variant(lightning_package, _ReadsNumPy)

    def run(callbacks):
        lightning_package.seed_everything(0, verbose=False)
        module = module_class()
        trainer = cpu_trainer(callbacks, lightning_package, max_steps=3)
        trainer.fit(module, loader())
        return Fit(module, trainer, (torch.get_rng_state(), torch.from_numpy(np.random.get_state()[1].copy()), random.getstate()))

    plain = run([])
    callback = LightMem(plan="auto", device_budget=TIGHT["automatic"])
    planned = run([callback])
    assert callback.chosen_plan is None
    assert_fits_equal(plain, planned)
    said = [str(w.message) for w in recwarn if str(w.message).startswith("lightmem: plan='auto' does not plan")]
    assert said == [
        "lightmem: plan='auto' does not plan this batch: its dry run could not trace the training step (EstimateError: "
        "the training step calls .numpy() (or another conversion to NumPy); fake tensors have no values to convert. "
        "Keep NumPy out of the training step's forward for the estimate (compute with torch ops, or pass loss_fn=... "
        "that skips it)). It trains with nothing changed (as written)."
    ]


def test_on_a_cuda_device_a_step_the_dry_run_cannot_trace_trains_with_every_block_checkpointed(recwarn):
    import pytorch_lightning as pl

    from lightmem.checkpoint import is_checkpointed
    from lightmem.testing.cuda_tensor import SimulatedCudaFit, simulated_cuda

    checkpointed: list[list[bool]] = []

    class Blocks(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            checkpointed.append([is_checkpointed(block) for block in pl_module.model.blocks])

    module_class = _variant(pl, _ReadsNumPy)
    with simulated_cuda():
        pl.seed_everything(0, verbose=False)
        plain = module_class()
        cpu_trainer([SimulatedCudaFit()], max_steps=2).fit(plain, loader())
        pl.seed_everything(0, verbose=False)
        planned = module_class()
        callback = LightMem(plan="auto", device_budget=TIGHT["automatic"], offload=False)
        cpu_trainer([SimulatedCudaFit(), callback, Blocks()], max_steps=2).fit(planned, loader())
    assert checkpointed == [[True, True, True], [True, True, True]]
    assert_same(plain.state_dict(), planned.state_dict(), "state_dict")
    said = [str(w.message) for w in recwarn if str(w.message).startswith("lightmem: plan='auto' does not plan")]
    assert len(said) == 1, said
    assert said[0].startswith(
        "lightmem: plan='auto' does not plan this batch: its dry run could not trace the training step (EstimateError: "
    )
    assert said[0].endswith("). It trains with checkpointing every block (6) while it does not plan.")


def test_an_error_of_the_users_step_is_raised_as_without_lightmem_at_its_step(lightning_package):
    module_class = _variant(lightning_package, _RaisesAtFirstBatch)
    raised = []
    for callbacks in ([], [LightMem(plan="auto", device_budget=ROOMY)]):
        with pytest.raises(Exception) as error:
            cpu_trainer(callbacks, lightning_package, max_steps=3).fit(module_class(), loader())
        raised.append((type(error.value), str(error.value)))
    assert raised == [(RuntimeError, "labels out of range in batch 0")] * 2


def test_in_a_fit_planning_copies_the_fits_optimizers_and_schedulers_and_runs_no_configure_optimizers(lightning_package):
    # A scheduler steps in its constructor and configure_optimizers may have effects of its own
    # (counted here in class attributes, where a stand-in's copy cannot keep them): planning builds
    # neither, copying the fit's own into the dry run.
    class CountedStepLR(torch.optim.lr_scheduler.StepLR):
        built = 0
        stepped = 0

        def __init__(self, *args, **kwargs):
            type(self).built += 1
            super().__init__(*args, **kwargs)

        def step(self, *args, **kwargs):
            type(self).stepped += 1
            super().step(*args, **kwargs)

    class Counting(idiom_class("automatic", lightning_package)):
        configured = 0

        def configure_optimizers(self):
            type(self).configured += 1
            self.my_opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            self.sched = CountedStepLR(self.my_opt, 1, gamma=0.5)
            return {"optimizer": self.my_opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

    counts = []
    for callbacks in ([], [LightMem(plan="auto", device_budget=TIGHT["automatic"])]):
        Counting.configured = CountedStepLR.built = CountedStepLR.stepped = 0
        cpu_trainer(callbacks, lightning_package, max_steps=3).fit(Counting(), loader())
        counts.append((Counting.configured, CountedStepLR.built, CountedStepLR.stepped))
    assert counts == [(1, 1, 4)] * 2  # the constructor's step, then one per optimizer step
