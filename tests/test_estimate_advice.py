"""Each advice rule fires on the situation it describes, and stays quiet otherwise."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from models import TinyGPT, gpt_loss
from torch import nn

from lightmem import estimate_memory
from lightmem.estimate.words import compact_names


def _rules(estimate) -> list[str]:
    return [item.rule for item in estimate.advice]


def _tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 33), generator=torch.Generator().manual_seed(0))


def test_static_memory_over_budget_says_no_activation_trick_helps_and_names_options():
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu", budget="2MiB")
    assert est.static_bytes > 2 * 2**20
    assert _rules(est)[0] == "static-exceeds-budget"
    message = est.advice[0].message
    for option in (
        "no activation technique",
        "bf16",
        "8-bit",
        "stateless",
        "FSDP",
        "ZeRO-Offload",
        "smaller model",
    ):
        assert option in message, option
    assert "reach-budget" not in _rules(est)


def test_no_budget_advice_when_the_step_fits():
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu", budget="1GiB")
    assert "static-exceeds-budget" not in _rules(est) and "reach-budget" not in _rules(est)


def test_reach_budget_names_blocks_to_checkpoint_when_static_memory_fits():
    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cpu")
    budget = base.static_bytes + (base.peak_bytes - base.static_bytes) // 2
    est = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cpu", budget=budget)
    advice = {item.rule: item.message for item in est.advice}
    assert "reach-budget" in advice
    assert "checkpoint blocks." in advice["reach-budget"] and "lightmem.plan" in advice["reach-budget"]


class OneHotClassifier(nn.Module):
    def __init__(self, vocab: int = 1000) -> None:
        super().__init__()
        self.proj = nn.Linear(vocab, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x)))


def _classify(model, x):
    return F.cross_entropy(model(x), torch.zeros(x.shape[0], dtype=torch.long))


def test_one_hot_dense_input_suggests_an_embedding():
    indices = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(0))
    one_hot = F.one_hot(indices, 1000).float()
    est = estimate_memory(OneHotClassifier(), one_hot, _classify, device="cpu")
    advice = [item for item in est.advice if item.rule == "dense-zero-input"]
    assert len(advice) == 1
    assert (
        "99.9% zeros" in advice[0].message
        and "one-hot" in advice[0].message
        and "nn.Embedding" in advice[0].message
    )


def test_dense_random_input_gets_no_sparse_advice():
    est = estimate_memory(OneHotClassifier(), torch.randn(64, 1000), _classify, device="cpu")
    assert "dense-zero-input" not in _rules(est)


class SdpaGPT(TinyGPT):
    """TinyGPT with its attention replaced by scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.attn.forward = _sdpa_forward.__get__(block.attn)


def _sdpa_forward(self, x):
    batch, seq, dim = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=-1)
    q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


def test_naive_attention_suggests_scaled_dot_product_attention():
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cpu")
    advice = [item for item in est.advice if item.rule == "quadratic-attention"]
    assert len(advice) == 1
    assert "scaled_dot_product_attention" in advice[0].message and "blocks.0-3" in advice[0].message


def test_fused_attention_gets_no_quadratic_advice():
    est = estimate_memory(SdpaGPT(), _tokens(), gpt_loss, device="cpu")
    assert "quadratic-attention" not in _rules(est)


def test_block_names_are_compacted_into_ranges():
    assert (
        compact_names(["blocks.0", "blocks.1", "blocks.2", "blocks.5", "head"])
        == "blocks.0-2, blocks.5, head"
    )


def test_static_advice_with_an_allowance_says_what_is_over_without_contradiction():
    from lightmem.config import format_bytes

    base = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cuda", overhead_bytes="4MiB")
    budget = base.static_bytes + 2**20  # the static part fits, not with the 4 MiB allowance
    est = estimate_memory(TinyGPT(), _tokens(), gpt_loss, device="cuda", overhead_bytes="4MiB", budget=budget)
    (message,) = [item.message for item in est.advice if item.rule == "static-exceeds-budget"]
    static = format_bytes(est.static_bytes)
    with_allowance = format_bytes(est.static_bytes + 4 * 2**20)
    assert (
        f"alone take {static}; with the 4.00 MiB overhead allowance that is {with_allowance}, which "
        f"leaves no room for activations in the {format_bytes(budget)} budget: no activation technique"
    ) in message
    assert "reach-budget" not in _rules(est)


def test_reach_budget_advice_is_the_verified_plan():
    from lightmem import plan
    from lightmem.config import format_bytes

    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cpu")
    budget = base.static_bytes + (base.peak_bytes - base.static_bytes) // 2
    est = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cpu", budget=budget)
    chosen = plan(TinyGPT(), _tokens(16), budget, gpt_loss, device="cpu")
    assert chosen.fits and chosen.checkpoint
    (message,) = [item.message for item in est.advice if item.rule == "reach-budget"]
    kinds = {name: "Block" for name in chosen.checkpoint}
    assert f"checkpoint {compact_names(chosen.checkpoint, kinds)} " in message
    assert f"brings the peak to {format_bytes(chosen.predicted_total_bytes)} with the overhead" in message
    # The plan's own estimate carries the same advice.
    assert [item.message for item in chosen.estimate.advice if item.rule == "reach-budget"] == [message]


def test_reach_budget_counts_what_the_allocator_reserves_as_the_fit_check_does():
    # A budget the allocated peak fits but the reserved one does not: the step does not fit, and
    # the bytes it needs are the reserved ones past the budget (they read "-893.83 MiB" for the
    # GPU runs' GPT at batch 11 under 16 GiB, counted from the allocated peak).
    from lightmem.config import format_bytes

    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0)
    baseline = base.scenarios["baseline"]
    assert baseline.reserved > baseline.peak_bytes
    budget = baseline.peak_bytes + 512 * 1024
    est = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0, budget=budget)
    assert est.baseline_fits is False
    (message,) = [item.message for item in est.advice if item.rule == "reach-budget"]
    assert f"the step needs {format_bytes(baseline.reserved - budget)} less" in message


def test_when_no_plan_fits_the_advice_says_so_with_the_plans_reason():
    from lightmem import plan

    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cpu")
    budget = base.static_bytes + 1024  # room for almost no activations
    est = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cpu", budget=budget)
    chosen = plan(TinyGPT(), _tokens(16), budget, gpt_loss, device="cpu")
    assert not chosen.fits
    (message,) = [item.message for item in est.advice if item.rule == "reach-budget"]
    assert f"no lightmem configuration gets it there ({chosen.reason})" in message


def _gpt2(vocab: int, width: int):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=4, vocab_size=vocab, n_positions=256)
    return transformers.GPT2LMHeadModel(config)


def _lm_batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (4, 256), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _hf_loss(model, batch):
    return model(**batch).loss


LOGITS_ADVICE = re.compile(
    r"the loss's logits \((?P<rows>[\d,]+) x 32,000, from lm_head\.weight\), their float32 copies and gradients "
    r"take (?P<logits>[\d.]+) MiB of the (?P<peak>[\d.]+) MiB peak \(\d+%, at backward: "
    r"_log_softmax_backward_data\); checkpointing and offload cannot reach them\. "
    r"lightmem\.linear_cross_entropy computes the loss from the hidden states in chunks and never holds them "
    r"whole: predicted peak about (?P<after>[\d.]+) MiB \([\d.]+ MiB less\), counting the [\d.]+ MiB of "
    r"gradients and one chunk of logits it keeps instead\. The change: (?P<change>.*)\.$"
)
HF_CHANGE = (
    "the model computes its own loss (labels=...): LightMem(chunked_loss=True) (in plain PyTorch "
    "lightmem.chunked_causal_lm_loss(model)) makes it chunked, with no change to the training step"
)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_logits_dominated_hugging_face_lm_is_told_to_chunk_its_own_loss_with_the_predicted_peak(device):
    import lightmem

    model, batch = _gpt2(32_000, 64), _lm_batch(32_000)
    est = estimate_memory(model, batch, _hf_loss, device=device)
    advice = [item.message for item in est.advice if item.rule == "loss-logits"]
    assert len(advice) == 1
    match = LOGITS_ADVICE.match(advice[0])
    assert match is not None, advice[0]
    assert match["change"] == HF_CHANGE
    assert float(match["peak"]) == round(est.peak_bytes / 2**20, 2)
    assert float(match["logits"]) > 0.8 * float(match["peak"])
    # The prediction is the estimator's own figure for the changed step, within 1% above it
    # (the prediction counts what the chunked loss keeps throughout the step).
    handle = lightmem.chunked_causal_lm_loss(model)
    chunked = estimate_memory(model, batch, _hf_loss, device=device)
    handle.remove()
    assert "loss-logits" not in _rules(chunked)
    assert chunked.peak_bytes <= est.loss_logits.peak_bytes_chunked <= 1.01 * chunked.peak_bytes


def _wide_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=32_000, dim=64, depth=2, seq=128)


def _wide_tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 32_000, (batch, 129), generator=torch.Generator().manual_seed(0))


def test_logits_advice_names_the_users_loss_line_and_the_chunked_call_that_replaces_it():
    from models import chunked_gpt_loss

    est = estimate_memory(_wide_gpt(), _wide_tokens(), gpt_loss, device="cpu")
    match = LOGITS_ADVICE.match(next(item.message for item in est.advice if item.rule == "loss-logits"))
    assert match is not None and match["rows"] == "512"
    assert match["change"] == (
        "in models.py:64, `return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))`, "
        "compute the loss as `lightmem.linear_cross_entropy(hidden, model.lm_head.weight, tokens[:, 1:].reshape(-1))`, "
        "where hidden is the output of model.ln_f, which model.lm_head reads (have the model return it in place of "
        "the logits)"
    )
    # That change (tests/models.py's chunked_gpt_loss) gives the predicted peak, within 1% above it.
    chunked = estimate_memory(_wide_gpt(), _wide_tokens(), lambda m, t: chunked_gpt_loss(m, t, None), device="cpu")
    assert chunked.peak_bytes <= est.loss_logits.peak_bytes_chunked <= 1.01 * chunked.peak_bytes


def _scaled_gpt_loss(model, tokens):
    logits = model(tokens[:, :-1]) * 0.5  # a logit scale between the head and the loss
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_logits_advice_proposes_no_replacement_that_would_drop_what_the_model_does_to_its_logits():
    est = estimate_memory(_wide_gpt(), _wide_tokens(), _scaled_gpt_loss, device="cpu", budget="512MiB")
    advice = next(item.message for item in est.advice if item.rule == "loss-logits")
    assert advice.endswith(
        "checkpointing and offload cannot reach them. The model changes the logits of lm_head.weight before its "
        "loss reads them (mul), which lightmem.linear_cross_entropy would leave out: no change is proposed."
    )
    assert est.chunked_loss is None and not est.loss_logits.replaceable  # nor a batch it would reach


def test_a_hugging_face_models_soft_capped_logits_are_carried_by_its_chunked_loss():
    import lightmem

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=32_000,
    )  # fmt: skip
    model, batch = transformers.Gemma2ForCausalLM(config), _lm_batch(32_000)
    est = estimate_memory(model, batch, _hf_loss, device="cpu")
    assert est.loss_logits.transform.softcap == 30.0  # read from the trace: tanh(logits / 30) * 30
    match = LOGITS_ADVICE.match(next(item.message for item in est.advice if item.rule == "loss-logits"))
    assert match is not None and match["change"] == HF_CHANGE
    handle = lightmem.chunked_causal_lm_loss(model)
    chunked = estimate_memory(model, batch, _hf_loss, device="cpu")
    handle.remove()
    assert "loss-logits" not in _rules(chunked)
    assert chunked.peak_bytes <= est.loss_logits.peak_bytes_chunked <= 1.01 * chunked.peak_bytes


def test_with_a_budget_the_logits_advice_gives_the_largest_batch_with_the_chunked_loss_and_without():
    from models import chunked_gpt_loss

    from lightmem import max_batch_size

    budget = 512 * 2**20
    est = estimate_memory(_wide_gpt(), _wide_tokens(), gpt_loss, device="cpu", budget=budget)
    as_written = max_batch_size(_wide_gpt(), _wide_tokens(), budget, gpt_loss, device="cpu").baseline
    chunked = max_batch_size(_wide_gpt(), _wide_tokens(), budget, lambda m, t: chunked_gpt_loss(m, t, None), device="cpu").baseline
    reach = est.chunked_loss
    assert (reach.budget_bytes, reach.as_written_batch_size) == (budget, as_written)
    assert est.to_dict()["chunked_loss"] == reach.to_dict()
    # Priced as chunked, the step is a little over the chunked step's own: never a batch more.
    assert chunked - 1 <= reach.batch_size <= chunked and reach.batch_size > 2 * as_written > 0
    advice = next(item.message for item in est.advice if item.rule == "loss-logits")
    assert advice.endswith(
        f" Under the 512.00 MiB budget without lightmem, batches up to {reach.batch_size} would fit with it, up to "
        f"{as_written} as written."
    )


def test_logits_advice_stays_quiet_when_the_logits_are_a_small_share_of_the_peak():
    est = estimate_memory(_gpt2(512, 128), _lm_batch(512), _hf_loss, device="cuda")
    assert "loss-logits" not in _rules(est)
