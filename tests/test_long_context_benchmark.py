"""``benchmarks/long_context.py`` without running its searches: its arguments, and the forward it
predicts for is LitGPT's own (its hidden states through LitGPT's head are LitGPT's logits). Nothing
here is timed; ``python benchmarks/long_context.py --tiny --measure`` runs its whole CPU path."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("litgpt")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import long_context  # noqa: E402


def test_the_benchmark_predicts_for_litgpts_own_forward_and_loss():
    torch.manual_seed(0)
    model = long_context.litgpt_model("Llama-3.2-1B", tiny=True, device="cpu")
    ids, targets = long_context.tokens(48, vocab=model.config.padded_vocab_size)
    hidden = long_context.hidden(model, ids)
    model.max_seq_length = 48
    assert torch.equal(model.lm_head(hidden), model(ids))
    from litgpt.utils import chunked_cross_entropy

    assert torch.equal(long_context.plain_loss(model, (ids, targets)), chunked_cross_entropy(model(ids), targets))
    assert long_context.chunked_loss(model, (ids, targets)).item() == pytest.approx(
        chunked_cross_entropy(model(ids), targets).item(), rel=1e-5
    )


def test_its_arguments_and_measure_needs_a_gpu_unless_tiny(capsys):
    args = long_context.parse_args(["--model", "1b", "--gpu", "h200", "--json", "rows.json"])
    assert (args.model, args.gpu, args.json, args.measure, args.tiny) == ("1b", "h200", "rows.json", False, False)
    assert long_context.parse_args(["--tiny", "--measure"]).measure
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            long_context.parse_args(["--measure"])
        assert "--measure trains on a GPU and this machine has none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        long_context.parse_args(["--gpu", "a100"])


def test_each_row_adds_one_action_to_the_one_before():
    model = long_context.litgpt_model("Llama-3.2-1B", tiny=True)
    steps = long_context._steps(model, "h100", tiny=False)
    assert [label for label, _, _ in steps] == [
        "without lightmem", "+ chunked loss", "+ checkpointing", "+ offload of checkpointed inputs", "+ tiling",
        "+ optimizer offload",
    ]  # fmt: skip
    configs = [config for _, _, config in steps]
    assert all(set(before) <= set(after) for before, after in zip(configs, configs[1:]))
    assert configs[-1]["tile"] == [f"transformer.h.{i}.{name}" for i in range(2) for name in ("norm_1", "norm_2", "mlp")]
    assert [loss for _, loss, _ in steps] == [long_context.plain_loss] + [long_context.chunked_loss] * 5
