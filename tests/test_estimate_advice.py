"""Each advice rule fires on the situation it describes, and stays quiet otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import TinyGPT, gpt_loss
from torch import nn

from lightmem import estimate_memory
from lightmem.estimate.advice import compact_names


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
