"""``estimate_memory(..., budget=...)``'s reach-the-budget advice and ``plan(...)`` search one space
(issue 58): on the same inputs the advice names the plan ``plan`` returns, at the peak it verified,
or refuses with its reason. Before, the advice searched a smaller space (no partial offload, the
engine's default windows instead of the plan's sized ones) and the two disagreed wherever a plan
offloads.

Three models, priced at an H100's table speeds on "cuda" (offload is planned there), each under
budgets between what its model state takes and what its step without lightmem reserves: a GPT
that checkpoints, a ResNet-like convnet laid out as users write it and a Hugging Face GPT-2 built
from a config, which offload.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layout_models import UserResNet
from models import TinyGPT, gpt_loss

from lightmem import estimate_memory, plan
from lightmem.config import format_bytes

COMMON = {"device": "cuda", "gpu": "h100", "overhead_bytes": 0}
FRACTIONS = (0.8, 0.6, 0.4, 0.25)
"""Budgets: the model state and this share of what the step without lightmem adds to it."""


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(depth=4), torch.zeros(32, 33, dtype=torch.long), gpt_loss


def _convnet():
    torch.manual_seed(0)
    images, labels = torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,))
    return UserResNet(), (images, labels), lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=128)
    tokens = torch.zeros(16, 128, dtype=torch.long)
    return transformers.GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}, None


CASES = {"gpt": (_gpt, "checkpoint"), "convnet": (_convnet, "offload"), "gpt2": (_gpt2, "offload")}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimates_reach_the_budget_advice_is_the_plan_at_every_budget(case):
    make, technique = CASES[case]
    model, batch, loss_fn = make()
    base = estimate_memory(model, batch, loss_fn, **COMMON)
    chosen_techniques = set()
    for fraction in FRACTIONS:
        budget = base.static_bytes + int((base.reserved_bytes - base.static_bytes) * fraction)
        advice = {item.rule: item.message for item in estimate_memory(model, batch, loss_fn, budget=budget, **COMMON).advice}
        chosen = plan(model, batch, budget, loss_fn, **COMMON)
        if chosen.fits:
            said = (
                " and ".join(chosen.parts()) + f" brings the peak to {format_bytes(chosen.predicted_total_bytes)} "
                "with the overhead allowance"
            )
            chosen_techniques.update({"checkpoint"} if chosen.checkpoint else set())
            chosen_techniques.update({"offload"} if chosen.offload is not None else set())
        else:
            said = f"no lightmem configuration gets it there ({chosen.reason})"
        assert said in advice["reach-budget"], f"{case} at {fraction:.0%}: plan says {said!r}"
    assert technique in chosen_techniques  # the budgets make the plans do what the model is here for
