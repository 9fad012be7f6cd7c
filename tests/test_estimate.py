"""estimate_memory: breakdown, model left untouched, precisions, optimizers, lightmem flags, errors."""

from __future__ import annotations

import os
import sys

import psutil
import pytest
import torch
import torch.nn.functional as F
from models import ConvNet, TinyGPT, gpt_loss
from torch import nn

from lightmem import estimate_memory
from lightmem.estimate import EstimateError
from lightmem.estimate.report import STAND_IN_NOTE
from lightmem.estimate.trace.records import CATEGORIES

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _tokens(batch: int = 4, seq: int = 33) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


PARAM_BYTES_MLP = (64 * 128 + 128 + 128 * 10 + 10) * 4


def test_breakdown_has_exactly_the_five_categories_summing_to_the_peak():
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu")
    assert list(est.breakdown) == list(CATEGORIES)
    assert sum(est.breakdown.values()) == est.peak_bytes
    assert est.overhead_bytes == 0 and est.total_bytes == est.peak_bytes


def test_parameters_gradients_and_adamw_state_are_exact_on_cpu():
    est = estimate_memory(_mlp(), torch.randn(32, 64), _mlp_loss, device="cpu", optimizer="adamw")
    assert est.breakdown["parameters"] == PARAM_BYTES_MLP
    # exp_avg + exp_avg_sq per parameter, and one float32 step counter per parameter tensor.
    assert est.scenarios["baseline"].breakdown["optimizer_state"] == 2 * PARAM_BYTES_MLP + 4 * 4
    assert est.static_bytes == PARAM_BYTES_MLP * 4 + 16


def test_sgd_without_momentum_has_no_optimizer_state():
    est = estimate_memory(_mlp(), torch.randn(32, 64), _mlp_loss, device="cpu", optimizer="sgd")
    assert est.breakdown["optimizer_state"] == 0


def test_cuda_rounds_every_allocation_to_512_bytes_and_keeps_step_counters_on_host():
    est = estimate_memory(_mlp(), torch.randn(32, 64), _mlp_loss, device="cuda", optimizer="adamw")
    rounded = sum((n * 4 + 511) // 512 * 512 for n in (64 * 128, 128, 128 * 10, 10))
    assert est.breakdown["parameters"] == rounded
    assert est.scenarios["baseline"].breakdown["optimizer_state"] == 2 * rounded
    assert all(value % 512 == 0 for value in est.breakdown.values())
    assert est.overhead_bytes == 1 << 30 and est.total_bytes == est.reserved_bytes + (1 << 30)


def test_real_model_is_left_untouched():
    model = TinyGPT()
    model.eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    identities = {name: id(p) for name, p in model.named_parameters()}
    estimate_memory(model, _tokens(), gpt_loss, device="cpu", checkpoint=["Block"], offload={"min_bytes": 0})
    for name, param in model.named_parameters():
        assert id(param) == identities[name]
        assert type(param) is nn.Parameter and param.grad is None
        assert torch.equal(param, before[name]), name
    assert not model.training and not any(m.training for m in model.modules())
    assert "forward" not in vars(model.blocks[0])  # checkpoint wrapping removed


def test_peak_location_names_phase_op_and_block():
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu")
    assert (est.peak_phase, est.peak_op) == ("forward", "nll_loss_forward")
    conv = estimate_memory(ConvNet(), torch.randn(8, 3, 16, 16), lambda m, x: m(x).sum(), device="cpu")
    assert conv.peak_phase == "backward"


def test_saved_activations_are_reported_per_top_level_block():
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu")
    assert [name for name in est.blocks if name.startswith("blocks.")] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
    ]
    sizes = {est.blocks[f"blocks.{i}"].saved_bytes for i in range(4)}
    assert len(sizes) == 1 and sizes.pop() > 0  # identical blocks keep identical activations
    assert est.blocks["blocks.0"].forward_flops == est.blocks["blocks.3"].forward_flops > 0


def test_bf16_mixed_shrinks_activations_and_bf16_true_halves_parameters():
    fp32 = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cuda")
    mixed = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cuda", precision="bf16-mixed")
    true = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu", precision="bf16-true")
    full = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu", precision="32-true")
    assert mixed.breakdown["activations"] < 0.8 * fp32.breakdown["activations"]
    assert mixed.breakdown["parameters"] == fp32.breakdown["parameters"]
    assert true.breakdown["parameters"] * 2 == full.breakdown["parameters"]


def test_offload_and_checkpoint_reduce_predicted_activations():
    est = estimate_memory(
        TinyGPT(), _tokens(8), gpt_loss, device="cuda", checkpoint=["Block"],
        offload={"min_bytes": "16KiB", "max_inflight_bytes": "64KiB"},  # copies to host wait on the device within it
    )
    assert list(est.scenarios) == ["baseline", "checkpoint", "offload", "checkpoint+offload"]
    base = est.scenarios["baseline"].activations_at_forward_end
    assert est.scenarios["checkpoint"].activations_at_forward_end < 0.5 * base
    assert est.scenarios["offload"].offloaded_bytes > 0 and est.scenarios["offload"].host_bytes > 0
    assert est.scenarios["offload"].peak_bytes < est.scenarios["baseline"].peak_bytes
    assert est.scenarios["checkpoint"].checkpointed == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    both = est.scenarios["checkpoint+offload"]
    assert est.peak_bytes == both.peak_bytes <= est.scenarios["checkpoint"].peak_bytes
    # Checkpointed blocks keep only their inputs, and offload moves those to host memory.
    assert both.activations_at_forward_end < est.scenarios["checkpoint"].activations_at_forward_end


def test_offload_scope_limits_what_is_offloaded():
    everything = estimate_memory(TinyGPT(), _tokens(8), gpt_loss, device="cuda", offload={"min_bytes": 0})
    one_block = estimate_memory(
        TinyGPT(), _tokens(8), gpt_loss, device="cuda", offload={"min_bytes": 0, "include": ["blocks.0"]}
    )
    assert (
        0
        < one_block.scenarios["offload"].offloaded_bytes
        < everything.scenarios["offload"].offloaded_bytes / 3
    )


class _LitMLPBody:
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}


def test_lightning_module_uses_training_step_and_configure_optimizers(lightning_package):
    lit_mlp = type("LitMLP", (_LitMLPBody, lightning_package.LightningModule), {})
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    est = estimate_memory(lit_mlp(), batch, device="cpu")
    assert est.optimizer == "SGD"
    assert est.breakdown["parameters"] == PARAM_BYTES_MLP
    assert est.scenarios["baseline"].breakdown["optimizer_state"] == PARAM_BYTES_MLP  # one momentum buffer
    # The LightningModule is looked through; the loss's saved tensors are outside every block.
    assert list(est.blocks) == ["net.0", "net.1", "net.2", "(outside blocks)"]


def test_gpt2_large_on_meta_is_estimated_without_real_allocation():
    from examples.estimate_factories import gpt2_large

    model, tokens, loss_fn = gpt2_large(16)
    rss_before = psutil.Process().memory_info().rss
    est = estimate_memory(model, tokens, loss_fn, precision="bf16-mixed", device="cuda")
    growth = psutil.Process().memory_info().rss - rss_before
    assert est.parameter_count == 774_030_080
    assert est.total_bytes > 40 * 10**9
    assert growth < 1 << 30, growth
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"optimizer": "adamx"},
            r"estimate_memory\(optimizer=...\): unknown optimizer 'adamx'; accepted: .*adamw",
        ),
        ({"precision": "8-mixed"}, r"estimate_memory\(precision=...\): unknown precision '8-mixed'"),
        ({"device": "tpu"}, r"estimate_memory\(device=...\): expected 'cuda' or 'cpu'"),
        ({"budget": "lots"}, r"estimate_memory\(budget=...\)"),
        ({"overhead_bytes": -1}, r"estimate_memory\(overhead_bytes=...\)"),
        ({"offload": {"threshold": 1}}, r"estimate_memory\(offload=...\): unknown key\(s\) 'threshold'"),
        ({"offload": {"include": ["blokcs.*"]}}, r"matches no module.*closest names"),
        ({"checkpoint": [3]}, r"estimate_memory\(checkpoint=...\)"),
    ],
)
def test_bad_arguments_fail_with_a_message_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(TinyGPT(), _tokens(), gpt_loss, **kwargs)


def test_a_loss_that_is_not_a_scalar_is_rejected():
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(4, 32, 128\), not a scalar loss"):
        estimate_memory(TinyGPT(), _tokens(seq=32), device="cpu")


def test_a_step_that_reads_tensor_values_is_estimated_saying_where_and_what_stood_in():
    def loss_with_item(model, tokens):
        loss = gpt_loss(model, tokens)
        if loss.item() > 0:
            return loss
        return loss * 2

    est = estimate_memory(TinyGPT(), _tokens(), loss_with_item, device="cpu")
    stood_in = f"a float read (.item(), float(t)) at test_estimate.py:{loss_with_item.__code__.co_firstlineno + 2} read as 1.0"
    assert est.stand_ins == [stood_in]
    assert est.peak_bytes == estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu").peak_bytes
    assert f"{STAND_IN_NOTE} {stood_in}." in " ".join(str(est).split())


def test_a_loss_fn_that_fails_on_a_lightning_module_says_it_receives_the_module_passed_as_model():
    from lit_models import LitGPT

    def inner_model_loss(model, tokens):  # written for the TinyGPT inside, given the LightningModule
        return gpt_loss(model.blocks, tokens)

    with pytest.raises(EstimateError) as raised:
        estimate_memory(LitGPT(), (_tokens(),), inner_model_loss, device="cpu")
    assert str(raised.value) == (
        "estimate_memory(loss_fn=...): loss_fn(model, batch) raised AttributeError: 'LitGPT' object has no "
        "attribute 'blocks'. loss_fn receives the object passed as model: here LitGPT, a LightningModule holding "
        "model (TinyGPT); call the module inside it as training_step does (model.model(...)), or leave loss_fn out "
        "to run training_step."
    )
    assert isinstance(raised.value.__cause__, AttributeError)


def test_a_loss_fn_that_fails_on_a_plain_module_says_what_it_was_given():
    with pytest.raises(EstimateError) as raised:
        estimate_memory(_mlp(), torch.randn(4, 64), lambda model, batch: model(x=batch), device="cpu")
    assert str(raised.value) == (
        "estimate_memory(loss_fn=...): loss_fn(model, batch) raised TypeError: Sequential.forward() got an "
        "unexpected keyword argument 'x'. loss_fn receives the object passed as model: here Sequential."
    )
    assert isinstance(raised.value.__cause__, TypeError)


def test_to_dict_and_text_carry_the_same_figures():
    import json

    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu", budget="1GiB")
    data = json.loads(json.dumps(est.to_dict()))
    assert data["peak_bytes"] == est.peak_bytes and data["breakdown"] == est.breakdown
    assert data["fits"] is True and data["scenarios"]["baseline"]["peak_bytes"] == est.peak_bytes
    text = est.to_text()
    assert "peak" in text and "blocks.0" in text and "Not modelled" in text


def test_a_plain_loop_zeroing_gradients_before_forward_frees_them_for_the_forward_peak():
    lightning = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu")
    plain = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu", zero_grad="before_forward")
    gradient_bytes = lightning.breakdown["parameters"]  # every parameter is trained, in float32
    # Lightning's order: the forward peak carries the previous step's gradients.
    assert lightning.peak_phase == "forward" and lightning.breakdown["gradients"] == gradient_bytes
    # Without them the forward's top is lower by exactly their bytes, and backward is the peak.
    assert plain.peak_phase == "backward"
    assert lightning.peak_bytes - gradient_bytes <= plain.peak_bytes < lightning.peak_bytes
    assert plain.breakdown["parameters"] == lightning.breakdown["parameters"]


def test_zero_grad_accepts_only_the_two_orders():
    with pytest.raises(ValueError) as caught:
        estimate_memory(TinyGPT(), _tokens(), gpt_loss, zero_grad="never")
    assert str(caught.value) == (
        "estimate_memory(zero_grad=...): expected one of 'after_forward', 'before_forward'; got 'never'"
    )
