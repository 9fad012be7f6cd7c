"""What users read of gradients under optimizer offload, where ``param.grad`` of the model is None
after backward: ``lightmem.named_grads``, the warning at fit start that names the hooks which would
read ``param.grad``, and the global gradient norm logged as a lightmem metric (bitwise
``torch.nn.utils.get_total_norm`` of the gradients without lightmem)."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from exact import assert_same
from lit_models import cpu_trainer
from optimizer_models import fit_tiny, lit_tiny_class, offloading_optimizer, regression_loader
from test_callback_metrics import MemoryLogger

from lightmem import LightMem, named_grads

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")


def _reads_gradients(package):
    """LitTiny with its BatchNorm frozen (no gradient there), recording in on_before_optimizer_step
    the gradients by name as ``named_grads`` reads them and as ``param.grad`` holds them, and
    Lightning's ``grad_norm``."""
    grad_norm = importlib.import_module(f"{package.__name__}.utilities").grad_norm

    class ReadsGradients(lit_tiny_class(package)):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.net[1].requires_grad_(False)
            self.seen = []

        def on_before_optimizer_step(self, optimizer):
            param_grads = {name: p.grad.clone() for name, p in self.named_parameters() if p.grad is not None}
            named = {name: grad.clone() for name, grad in named_grads(self).items()}
            self.seen.append((named, param_grads, grad_norm(self, norm_type=2)))

    return ReadsGradients


def test_named_grads_gives_the_host_gradients_under_the_names_lightnings_grad_norm_uses(lightning_package):
    module_class = _reads_gradients(lightning_package)
    reference, _, _ = fit_tiny(None, lightning_package, module_class=module_class, accumulate_grad_batches=2)
    module, _, _ = fit_tiny(offloading_optimizer(), lightning_package, module_class=module_class, accumulate_grad_batches=2)
    assert len(module.seen) == len(reference.seen) == 4
    for (named, param_grads, norms), (_, expected, expected_norms) in zip(module.seen, reference.seen):
        assert param_grads == {} and norms == {}  # what the model's parameters hold under optimizer offload
        assert {f"grad_2.0_norm/{name}" for name in named} | {"grad_2.0_norm_total"} == set(expected_norms)
        assert_same(expected, named, "gradients by name")


def _fit_start_warnings(lightning_package, module_class, callbacks=()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback = offloading_optimizer()
        lightning_package.seed_everything(0, verbose=False)
        trainer = cpu_trainer([callback, *callbacks], lightning_package)
        trainer.fit(module_class(), regression_loader())
    return [str(warning.message) for warning in caught if "param.grad" in str(warning.message)]


_GRADIENTS_ELSEWHERE = (
    "lightmem: LightMem(offload_optimizer=...): param.grad of the model's parameters is None between backward "
    "and the optimizer step (the gradients are on the host), where {} runs: read them with "
    "lightmem.named_grads(module), by the names grad_norm gives"
)


def _overriding(base: type, name: str, hook: str) -> type:
    """A subclass of ``base`` called ``name`` whose ``hook`` does what ``base``'s does."""

    def override(self, *args, **kwargs):
        return getattr(base, hook)(self, *args, **kwargs)

    return type(name, (base,), {hook: override})


@pytest.mark.parametrize("hook", ["on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"])
def test_the_fit_start_warning_names_the_modules_hook_that_would_read_gradients(lightning_package, hook):
    module_class = _overriding(lit_tiny_class(lightning_package), "LogsGradients", hook)
    assert _fit_start_warnings(lightning_package, module_class) == [_GRADIENTS_ELSEWHERE.format(f"LogsGradients.{hook}")]


@pytest.mark.parametrize("hook", ["on_after_backward", "on_before_optimizer_step"])
def test_the_fit_start_warning_names_the_callbacks_hook_that_would_read_gradients(lightning_package, hook):
    callback = _overriding(lightning_package.Callback, "GradLogger", hook)()
    warned = _fit_start_warnings(lightning_package, lit_tiny_class(lightning_package), [callback])
    assert warned == [_GRADIENTS_ELSEWHERE.format(f"GradLogger.{hook}")]


def test_the_fit_start_warning_names_training_step_under_manual_optimization(lightning_package):
    base = lit_tiny_class(lightning_package)
    module_class = type("ManualSteps", (base,), {"__init__": lambda self: base.__init__(self, manual=True)})
    warned = _fit_start_warnings(lightning_package, module_class)
    assert warned == [_GRADIENTS_ELSEWHERE.format("ManualSteps.training_step (manual optimization, after manual_backward)")]


def test_no_fit_start_warning_where_nothing_reads_gradients_between_backward_and_the_step(lightning_package):
    assert _fit_start_warnings(lightning_package, lit_tiny_class(lightning_package)) == []


GRAD_NORM = "lightmem/memory/optimizer/grad_norm"


def _records_norms(package):
    """LitTiny recording, where Lightning's grad_norm recipe reads gradients (before clipping),
    ``torch.nn.utils.get_total_norm`` of its gradients: the reference, run without lightmem."""

    class RecordsNorms(lit_tiny_class(package)):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norms = []

        def on_before_optimizer_step(self, optimizer):
            self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None]))

    return RecordsNorms


_CLIPPING = {None: {}, "norm": {"gradient_clip_val": 0.5}, "value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}}


@pytest.mark.parametrize("clip", list(_CLIPPING), ids=["no-clipping", "clip-by-norm", "clip-by-value"])
@pytest.mark.parametrize(("overlap", "overlapped_steps"), [("auto", 3), (False, 0)], ids=["overlapped", "after-backward"])
def test_the_logged_gradient_norm_is_get_total_norm_of_the_gradients_without_lightmem(
    lightning_package, clip, overlap, overlapped_steps, optimizer_offload_transport
):
    settings = {"accumulate_grad_batches": 2, **_CLIPPING[clip]}
    reference, _, _ = fit_tiny(None, lightning_package, module_class=_records_norms(lightning_package), **settings)
    logger = MemoryLogger()
    callback = LightMem(
        offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1,
        offload_overlap_step=overlap,
    )  # fmt: skip
    fit_tiny(callback, lightning_package, logger=logger, **settings)
    logged = [metrics[GRAD_NORM] for _, metrics in logger.metrics if GRAD_NORM in metrics]
    assert logged == [float(norm) for norm in reference.norms] and len(logged) == 4
    assert callback.optimizer_offload_stats[0].overlapped_steps == overlapped_steps


def test_the_gradient_norm_is_taken_only_for_the_steps_whose_metrics_are_read(lightning_package):
    # Lightning logs every 2nd step here (steps 2 and 4); lightmem also reads the fit's first.
    reference, _, _ = fit_tiny(None, lightning_package, module_class=_records_norms(lightning_package))
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=["lightmem"])

    class StepNorms(lightning_package.Callback):
        norms = []

        def on_train_batch_end(self, trainer, *args):
            self.norms.append(callback.optimizer_offload_stats[0].grad_norm)

    logger = MemoryLogger()
    lightning_package.seed_everything(0, verbose=False)
    trainer = cpu_trainer([callback, StepNorms()], lightning_package, logger=logger, log_every_n_steps=2)
    trainer.fit(lit_tiny_class(lightning_package)(), regression_loader())
    expected = [float(norm) for norm in reference.norms]
    assert StepNorms.norms == [expected[0], expected[1], None, expected[3]]
    assert [metrics[GRAD_NORM] for _, metrics in logger.metrics if GRAD_NORM in metrics] == [expected[1], expected[3]]
