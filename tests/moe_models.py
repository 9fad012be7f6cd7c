"""Mixture-of-experts models as their users build them, with routers whose choices are set by hand.

Four families, each 2 layers of width 64 with 4 experts, top-2: LitGPT's ``LLaMAMoE`` (a per-expert
``torch.where(mask)`` loop), Hugging Face's Mixtral and Qwen2-MoE on their eager experts path
(``one_hot``, ``nonzero`` of the experts hit, ``torch.where`` and ``index_add_`` per expert), and a
top-k MoE written by hand (``topk``, ``torch.where(indices == e)``, ``index_add_``).

Routing is decided by the tokens: ``route_by_token`` writes each token's group (``id % GROUPS``)
into the first ``GROUPS`` dimensions of its embedding, much larger than the rest, and sets every
router to read them: a token of group ``g`` picks experts ``g * TOP_K ... g * TOP_K + TOP_K - 1``.
So a batch with as many tokens of each group (``balanced_batch``) spreads them evenly (each expert
gets tokens x top-k / experts), and a batch of group-0 tokens only (``skewed_batch``) sends every
token to the same top-k experts. ``RoutingCounts`` records what each router chose in a real step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

EXPERTS, TOP_K, WIDTH, HIDDEN, LAYERS = 4, 2, 64, 128, 2
GROUPS = EXPERTS // TOP_K
VOCAB, BATCH, SEQ = 128, 2, 32
FAMILIES = ("litgpt", "mixtral", "qwen2_moe", "by_hand")
BLOCKS = {"litgpt": "Block", "mixtral": "MixtralDecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer", "by_hand": "MoEBlock"}


class TopKMoE(nn.Module):
    """A top-k mixture of experts as it is often written by hand: each expert takes the rows routed
    to it (``torch.where`` of a mask), and its weighted output is added back with ``index_add_``."""

    def __init__(self, width: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, chosen = self.gate(rows).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(rows)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out.index_add_(0, token, expert(rows[token]) * weights[token, slot, None])
        return out.view_as(x)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.moe = TopKMoE(WIDTH, HIDDEN, EXPERTS, TOP_K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class ByHandLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(family: str, seed: int = 0) -> nn.Module:
    """The family's model, in train mode, routing by token (``route_by_token``)."""
    torch.manual_seed(seed)
    if family == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config.from_name(
            "Mixtral-8x7B-v0.1", n_layer=LAYERS, n_embd=WIDTH, n_head=4, n_query_groups=2, intermediate_size=HIDDEN,
            padded_vocab_size=VOCAB, vocab_size=VOCAB, n_expert=EXPERTS, n_expert_per_token=TOP_K, block_size=SEQ,
        )  # fmt: skip
        model = GPT(config)
        model.apply(model._init_weights)
    elif family in ("mixtral", "qwen2_moe"):
        import transformers

        transformers.logging.set_verbosity_error()
        common = {
            "num_hidden_layers": LAYERS, "hidden_size": WIDTH, "intermediate_size": HIDDEN, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": VOCAB, "num_experts_per_tok": TOP_K, "experts_implementation": "eager",
        }  # fmt: skip
        if family == "mixtral":
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=EXPERTS, **common))
        else:
            config = transformers.Qwen2MoeConfig(
                num_experts=EXPERTS, moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN, **common
            )
            model = transformers.Qwen2MoeForCausalLM(config)
        assert model.config._experts_implementation == "eager"
    elif family == "by_hand":
        model = ByHandLM()
    else:
        raise KeyError(family)
    route_by_token(model)
    return model.train()


def embedding_of(model: nn.Module) -> nn.Embedding:
    return next(module for module in model.modules() if isinstance(module, nn.Embedding))


def routers_of(model: nn.Module) -> list[nn.Module]:
    """Each layer's router: the module named ``gate`` whose weight has one row per expert."""
    return [
        module for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "gate" and getattr(module, "weight", None) is not None
        and tuple(module.weight.shape) == (EXPERTS, WIDTH)
    ]  # fmt: skip


@torch.no_grad()
def route_by_token(model: nn.Module, strength: float = 1.0, sharpness: float = 4.0) -> None:
    """Token ``t`` of group ``t % GROUPS`` carries ``strength`` in dimension ``t % GROUPS`` of its
    embedding (nothing in the other group dimensions); each router scores expert ``e`` by dimension
    ``e // TOP_K`` (times ``sharpness``), so a token's top-k are its group's experts."""
    weight = embedding_of(model).weight
    weight[:, :GROUPS] = 0.0
    tokens = torch.arange(weight.shape[0])
    weight[tokens, tokens % GROUPS] = strength
    routers = routers_of(model)
    assert len(routers) == LAYERS, [type(router).__name__ for router in routers]
    for router in routers:
        router.weight.zero_()
        for expert in range(EXPERTS):
            router.weight[expert, expert // TOP_K] = sharpness


def _ids(groups: Callable[[torch.Tensor], torch.Tensor], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(BATCH * SEQ).view(BATCH, SEQ)
    return torch.randint(0, VOCAB // GROUPS, (BATCH, SEQ), generator=generator) * GROUPS + groups(positions)


def balanced_ids(seed: int = 1) -> torch.Tensor:
    """As many tokens of each group: every expert gets BATCH x SEQ x TOP_K / EXPERTS tokens."""
    return _ids(lambda positions: positions % GROUPS, seed)


def skewed_ids(seed: int = 1) -> torch.Tensor:
    """Tokens of group 0 only: every token goes to experts 0 ... TOP_K - 1."""
    return _ids(lambda positions: torch.zeros_like(positions), seed)


def batch_of(family: str, ids: torch.Tensor) -> Any:
    """What the family's loss function takes (``loss_fn``)."""
    return {"input_ids": ids, "labels": ids.clone()} if family in ("mixtral", "qwen2_moe") else ids


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def loss_fn(family: str) -> Callable[[nn.Module, Any], torch.Tensor]:
    return _hf_loss if family in ("mixtral", "qwen2_moe") else _next_token_loss


class RoutingCounts:
    """Tokens per expert each router chose in a real forward (a forward hook on each router)."""

    def __init__(self, model: nn.Module) -> None:
        self.counts: list[list[int]] = []
        self._hooks = [router.register_forward_hook(self._seen) for router in routers_of(model)]

    def _seen(self, module: nn.Module, inputs: Any, output: Any) -> None:
        # Hugging Face's routers return (logits, scores, indices); LitGPT's and ours are a Linear.
        indices = output[2] if isinstance(output, tuple) else output.topk(TOP_K, dim=-1).indices
        self.counts.append(torch.bincount(indices.flatten(), minlength=EXPERTS).tolist())

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def lightning_module(family: str, package: Any) -> Any:
    """The family's model in a LightningModule of ``package`` (``pytorch_lightning`` or ``lightning.pytorch``)."""

    class LitMoE(package.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(family)
            self.loss = loss_fn(family)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LitMoE()


def loader(family: str, batches: int = 3) -> Any:
    """Balanced batches, then a skewed one (what the plan must hold)."""
    from torch.utils.data import DataLoader

    ids = [balanced_ids(seed) for seed in range(1, batches)] + [skewed_ids(batches)]
    return DataLoader([batch_of(family, each) for each in ids], batch_size=None)
