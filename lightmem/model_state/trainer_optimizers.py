"""Optimizer offload of a Lightning Trainer: every optimizer of a fit, what its strategy allows,
whether the host step may overlap backward there, and a restored state kept on the host.

``pytorch_lightning`` and ``lightning.pytorch`` Trainers both work: the strategy is recognised by the
Lightning class it derives from, in either package (``lightmem.lightning_packages``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightmem.config import OptimizerOffloadSettings
from lightmem.lightning_packages import is_mock_optimizer, is_strategy
from lightmem.model_state.device_dtype import refuse_precision
from lightmem.model_state.grad_clip import GradClip
from lightmem.model_state.offloader import InstanceAttribute, OptimizerOffloader
from lightmem.model_state.overlap import overlap_refusal
from lightmem.model_state.refusals import refuse_bucket_views
from lightmem.transfer.transport import Transport

# Strategies that shard the model state and offload it their own way, by the Lightning class they
# derive from; checked before DDP, from which DeepSpeedStrategy derives.
_STRATEGY_REFUSALS = {
    "FSDPStrategy": "FSDP shards the optimizer state itself and has its own CPU offload: use "
    "FSDPStrategy(cpu_offload=True) (FSDP2: CPUOffloadPolicy) instead",
    "DeepSpeedStrategy": "DeepSpeed has its own: use DeepSpeedStrategy(offload_optimizer=True)",
    "ModelParallelStrategy": "it shards parameters and optimizer state (FSDP2, tensor parallelism): "
    "apply FSDP2's CPUOffloadPolicy in configure_model instead",
}


def offload_trainer_optimizers(
    trainer: Any,
    settings: OptimizerOffloadSettings,
    transport: Transport | None = None,
    grad_norm_wanted: Callable[[], bool] | None = None,
) -> tuple[list[OptimizerOffloader], str | None]:
    """Offload every optimizer of a Lightning ``trainer`` (after its strategy set them up).

    Returns the offloaders, or none and the reason the option is off (no optimizer:
    ``configure_optimizers`` returned None; parameters on a device type ``settings.devices`` does
    not name, e.g. no CUDA). ``pytorch_lightning`` and ``lightning.pytorch`` Trainers both work,
    and so does any subclass of their ``SingleDeviceStrategy`` or ``DDPStrategy``.

    Under DDP each rank offloads its own copy; gradients leave once DDP has averaged them (at the
    end of each synchronised backward; under ``no_sync`` accumulation they stay on the device).

    ``grad_norm_wanted()`` says, during a step, whether that step takes the global norm of its
    gradients (``stats.grad_norm``): before Lightning clips them, or as they land where the step
    overlaps backward.

    Raises:
        ValueError: naming ``settings.flag("enabled")``, under a strategy that does not derive from
            ``SingleDeviceStrategy`` or ``DDPStrategy`` or shards the model state (FSDP, DeepSpeed and
            ``ModelParallelStrategy`` point to their own offload), with DDP's
            ``gradient_as_bucket_view=True``, with a gradient scaler (16-mixed), or with
            ``device_dtype`` under a precision other than bf16-mixed.
    """
    flag = settings.flag("enabled")
    optimizers = [optimizer for optimizer in trainer.optimizers if not is_mock_optimizer(optimizer)]
    if not optimizers:
        return [], "configure_optimizers returned None: the fit has no optimizer, nothing to offload"
    strategy, name = trainer.strategy, type(trainer.strategy).__name__
    for base, why in _STRATEGY_REFUSALS.items():
        if is_strategy(strategy, base):
            raise ValueError(f"{flag}: not available under {name}: {why}")
    reducer = None
    if is_strategy(strategy, "DDPStrategy"):
        reducer = strategy.model  # the DistributedDataParallel wrapper
        refuse_bucket_views(reducer, flag, "use DDPStrategy(gradient_as_bucket_view=False)")
    elif not is_strategy(strategy, "SingleDeviceStrategy"):
        raise ValueError(
            f"{flag}: works with one device per process, unsharded (SingleDeviceStrategy, DDPStrategy or a "
            f"subclass of either); got {name}"
        )
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"{flag}: a gradient scaler (precision='16-mixed') unscales and checks gradients per device "
            "and cannot run on host gradients; use precision='bf16-mixed', 'bf16-true' or '32-true'"
        )
    model = trainer.lightning_module
    device = trainer.strategy.root_device
    if device.type not in settings.devices:
        return [], f"the model is on {device}, not a device type in {settings.flag('devices')}"
    if settings.device_dtype is not None:
        refuse_precision(trainer, settings)  # only where the option is on: a CPU-only run keeps going
    offloaders = []
    clip = GradClip.lightning(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
    for optimizer in optimizers:
        why_not = None if settings.overlap_step is False else _why_no_overlap(trainer, optimizer, reducer, settings)
        if why_not is not None and settings.overlap_step is True:
            raise ValueError(f"{settings.flag('overlap_step')}: not possible in this fit: {why_not}; leave it 'auto' or False")
        overlap = "step-closure" if settings.overlap_step is not False and why_not is None else None
        offloader = OptimizerOffloader(
            model, optimizer, settings=settings, transport=transport, reducer=reducer, overlap=overlap,
            clip=clip if overlap else None,
        )  # fmt: skip
        if grad_norm_wanted is not None:
            offloader.grad_norm_wanted = grad_norm_wanted
        offloader.overlap_note = (
            f"host step overlapped with backward{f', {clip} as gradients land' if clip else ''}"
            if overlap
            else f"host step after backward: {why_not or 'overlap_step=False'}"
        )
        offloaders.append(offloader)
    if offloaders:
        _keep_restored_state_on_host(trainer.strategy, offloaders)
        _clip_in_the_overlapped_step(trainer.precision_plugin, offloaders)
        for callback in trainer.callbacks:
            _finetuning_sees_device_params(callback, offloaders)
        _toggle_device_params(model, trainer, offloaders)
    return offloaders, None


@contextlib.contextmanager
def _device_params_in_groups(offloaders: list[OptimizerOffloader], optimizers: list[Any]) -> Iterator[None]:
    """For the duration, ``optimizers``' param groups hold the device parameters in place of their
    host copies (a group added meanwhile keeps what it holds): for Lightning code that reads or
    sets the parameters through the groups."""
    to_device = {id(host): param for offloader in offloaders for param, host in offloader.host_copies()}
    kept = [(group, group["params"]) for optimizer in optimizers for group in optimizer.param_groups]
    try:
        for group, params in kept:
            group["params"] = [to_device.get(id(param), param) for param in params]
        yield
    finally:
        for group, params in kept:
            group["params"] = params


def _toggle_device_params(module: Any, trainer: Any, offloaders: list[OptimizerOffloader]) -> None:
    """``LightningModule.toggle_optimizer`` (manual optimization with several optimizers, as GANs
    do) turns off ``requires_grad`` of the parameters in the other optimizers' groups, and
    ``untoggle_optimizer`` restores it. While offloaded the groups hold host copies: the toggle
    acts on the device parameters, which are the ones backward sees."""
    for name in ("toggle_optimizer", "untoggle_optimizer"):
        lightnings = getattr(module, name)

        def toggled(optimizer: Any, lightnings: Any = lightnings) -> Any:
            with _device_params_in_groups(offloaders, list(trainer.optimizers)):
                return lightnings(optimizer)

        setattr(module, name, toggled)
        offloaders[0].remove_at_close(InstanceAttribute(module, name))


def _finetuning_sees_device_params(callback: Any, offloaders: list[OptimizerOffloader]) -> None:
    """Lightning's ``BaseFinetuning`` (``BackboneFinetuning``) names the parameters of the param
    groups by looking them up in ``named_parameters()``, and on resume puts the module's parameters
    back into the groups it saved; before it adds a group it compares the parameters to add with
    those in the groups (``filter_on_optimizer``: ``torch.equal``, which raises across devices).
    While offloaded the groups hold host copies: its lookups and comparisons see the device
    parameter of each, and the groups it restores get the host copies back (a parameter not
    offloaded yet is taken before the checkpoint's state loads or the next step,
    ``OptimizerOffloader.adopt_param_groups``)."""
    if not any(cls.__name__ == "BaseFinetuning" for cls in type(callback).__mro__):
        return
    lightnings = callback._apply_mapping_to_param_groups

    def apply_mapping_to_param_groups(param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        pairs = [pair for offloader in offloaders for pair in offloader.host_copies()]
        to_device = {id(host): param for param, host in pairs}
        to_host = {id(param): host for param, host in pairs}
        groups = [{**group, "params": [to_device.get(id(p), p) for p in group["params"]]} for group in param_groups]
        mapped = lightnings(groups, mapping)
        return [{**group, "params": [to_host.get(id(p), p) for p in group["params"]]} for group in mapped]

    lightnings_unfreeze = callback.unfreeze_and_add_param_group

    def unfreeze_and_add_param_group(modules: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        with _device_params_in_groups(offloaders, [optimizer]):
            lightnings_unfreeze(modules, optimizer, *args, **kwargs)  # adds its group through lightmem's

    callback._apply_mapping_to_param_groups = apply_mapping_to_param_groups
    callback.unfreeze_and_add_param_group = unfreeze_and_add_param_group
    for name in ("_apply_mapping_to_param_groups", "unfreeze_and_add_param_group"):
        offloaders[0].remove_at_close(InstanceAttribute(callback, name))


def _clip_in_the_overlapped_step(precision: Any, offloaders: list[OptimizerOffloader]) -> None:
    """Lightning clips after the closure's backward, through ``precision.clip_gradients`` (also
    ``self.clip_gradients`` under manual optimization). The gradient norm, where the step takes
    it, is taken before. Where the overlapped step already clipped (as gradients landed), that
    call is taken as done; anywhere else (a step after backward, another optimizer) Lightning
    clips as usual."""
    lightnings = precision.clip_gradients

    def clip_gradients(optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None, **kwargs: Any) -> None:
        stepped = getattr(optimizer, "_optimizer", optimizer)  # manual optimization passes a LightningOptimizer
        for offloader in offloaders:
            if offloader.optimizer is not stepped:
                continue
            offloader.take_grad_norm()
            if offloader.takes_clipping(clip_val, gradient_clip_algorithm):
                return
        if gradient_clip_algorithm is not None:
            kwargs["gradient_clip_algorithm"] = gradient_clip_algorithm
        lightnings(optimizer, clip_val, **kwargs)

    precision.clip_gradients = clip_gradients
    offloaders[0].remove_at_close(InstanceAttribute(precision, "clip_gradients"))


def _keep_restored_state_on_host(strategy: Any, offloaders: list[OptimizerOffloader]) -> None:
    """On ``fit(ckpt_path=...)`` Lightning loads each optimizer's state and then moves it to the
    device (``Strategy.load_optimizer_state_dict``), which would hold the whole state there until
    the first step moved it back: the memory this option exists to save. While offloaded, the state
    is only loaded: ``load_state_dict`` puts it beside the host copies the groups hold (groups
    restored since with device parameters, by ``BaseFinetuning``, are offloaded first)."""

    def load_optimizer_state_dict(checkpoint: Any) -> None:
        for offloader in offloaders:
            offloader.adopt_param_groups()
        for optimizer, state in zip(strategy.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    strategy.load_optimizer_state_dict = load_optimizer_state_dict
    offloaders[0].remove_at_close(InstanceAttribute(strategy, "load_optimizer_state_dict"))


# Hooks that run between the backward of an optimizer step's closure and the step: overridden,
# they may change gradients (or read the host parameters) there.
_BETWEEN_BACKWARD_AND_STEP = (
    "backward", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "clip_gradients",
    "optimizer_step",
)  # fmt: skip
# The precision plugin's clipping, which the overlapped step replaces: overridden, it may clip otherwise.
_PRECISION_CLIPPING = ("clip_gradients", "clip_grad_by_norm", "clip_grad_by_value")


# Hooks that run between the backward of an optimizer step and the step, where user code reads
# gradients (Lightning's grad_norm recipe, clipping of one's own): param.grad of the model is None there.
_READ_GRADIENTS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")


def gradient_readers(trainer: Any) -> list[str]:
    """Where user code runs between backward and the optimizer step, as ``Class.hook``: the
    LightningModule's and the callbacks' overrides of ``on_after_backward``,
    ``on_before_optimizer_step`` and ``configure_gradient_clipping``, and under manual optimization
    the module's ``training_step``. Under optimizer offload ``param.grad`` of the model is None
    there (``lightmem.named_grads`` reads the host gradients)."""
    module = trainer.lightning_module
    found = [
        f"{type(owner).__name__}.{name}"
        for owner in (module, *trainer.callbacks)
        for name in _READ_GRADIENTS
        if _defined_by_user(owner, name)
    ]
    if not module.automatic_optimization:
        found.append(f"{type(module).__name__}.training_step (manual optimization, after manual_backward)")
    return found


def _defined_by_user(instance: Any, name: str) -> bool:
    """Whether ``name`` on ``instance`` comes from a class outside Lightning (either package)."""
    for cls in type(instance).__mro__:
        if name in vars(cls):
            return not cls.__module__.split(".")[0] in ("pytorch_lightning", "lightning", "lightning_fabric")
    return False


def _why_no_overlap(
    trainer: Any, optimizer: torch.optim.Optimizer, reducer: Any, settings: OptimizerOffloadSettings
) -> str | None:
    """Why this fit cannot step on the host during backward, or None: under Lightning the step
    follows the backward of its closure, and nothing between them may change a gradient."""
    module = trainer.lightning_module
    if settings.device_dtype is not None:
        return f"{settings.flag('device_dtype')} widens bf16 gradients into the fp32 masters after backward"
    if not module.automatic_optimization:
        return "manual optimization (lightmem cannot see what runs between backward and the step)"
    if reducer is not None:
        return "DDP averages gradients at the end of backward"
    for name in _BETWEEN_BACKWARD_AND_STEP:
        if _defined_by_user(module, name):
            return f"the LightningModule overrides {name}"
    for callback in trainer.callbacks:
        for name in ("on_after_backward", "on_before_optimizer_step"):
            if _defined_by_user(callback, name):
                return f"callback {type(callback).__name__} overrides {name}"
    precision = trainer.precision_plugin
    if _defined_by_user(precision, "optimizer_step"):
        return f"precision plugin {type(precision).__name__} has its own optimizer_step"
    for name in _PRECISION_CLIPPING:  # called after the closure even without gradient_clip_val
        if _defined_by_user(precision, name):
            return f"precision plugin {type(precision).__name__} has its own {name}"
    return overlap_refusal(optimizer)
