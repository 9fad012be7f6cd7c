"""A Hugging Face causal LM's loss without its full logits: ``linear_cross_entropy``.

    python examples/hf_linear_cross_entropy.py

With a large vocabulary the peak of a training step is often the loss: ``model(labels=...)``
makes logits of shape (tokens, vocabulary), a float32 copy, their log-softmax and, in backward,
gradients of the same size. lightmem's estimator says so (advice ``loss-logits``). torch 2.13's
``torch.nn.functional.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` computes the loss
from the hidden states in chunks and never holds the logits whole. The change is the
``chunked_causal_lm_loss`` function below; this script checks that it gives the same loss and
gradients as ``model(labels=...).loss`` (to float32 rounding: the sums run in another order) and
prints the estimator's peak of both (a tiny GPT-2 with a 32k vocabulary, estimated for CUDA).

It runs on CPU in a few seconds; nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from lightmem import estimate_memory


def chunked_causal_lm_loss(model: transformers.PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(**batch).loss`` for a causal LM, computed without materialising the logits.

    The base model gives the hidden states; the output head's weight (and bias, if any) goes to
    ``linear_cross_entropy`` with labels shifted as Hugging Face shifts them (each position
    predicts the next token; -100 is ignored). Models that post-process logits (soft-capping,
    a logit scale) need that applied differently: this function is for a plain linear head.
    """
    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    head = model.get_output_embeddings()
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    return F.linear_cross_entropy(
        hidden.last_hidden_state.flatten(0, 1),
        head.weight,
        labels.flatten(),
        linear_bias=head.bias,
        ignore_index=-100,
        options=torch.nn.LinearCrossEntropyOptions(),
    )


def hf_loss(model: transformers.PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    vocab = 32_000
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, (4, 256), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch["labels"][:, :8] = -100  # a prompt the loss ignores

    # Dropout off so that both losses see the same network.
    model.eval()
    reference = hf_loss(model, batch)
    expected = gradients(model, reference)
    chunked = chunked_causal_lm_loss(model, batch)
    actual = gradients(model, chunked)
    loss_diff = abs(reference.item() - chunked.item())
    grad_diff = max((expected[name] - actual[name]).abs().max().item() for name in expected)
    grad_scale = max(expected[name].abs().max().item() for name in expected)
    print(f"loss: model(labels=...) {reference.item():.6f}, linear_cross_entropy {chunked.item():.6f}")
    print(f"largest difference: loss {loss_diff:.2e}, gradients {grad_diff:.2e} (largest gradient {grad_scale:.2e})")
    assert expected.keys() == actual.keys()
    assert loss_diff <= 1e-5 * abs(reference.item()), "losses differ beyond float32 rounding"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    print("loss and gradients match (rtol 1e-4, atol 1e-6)")

    model.train()
    before = estimate_memory(model, batch, hf_loss, device="cuda")
    after = estimate_memory(model, batch, chunked_causal_lm_loss, device="cuda")
    print(f"estimated peak on CUDA: model(labels=...) {before.peak_bytes / 2**20:.1f} MiB, "
          f"linear_cross_entropy {after.peak_bytes / 2**20:.1f} MiB")  # fmt: skip
    for item in before.advice:
        if item.rule == "loss-logits":
            print(f"advice [{item.rule}]: {item.message}")


if __name__ == "__main__":
    main()
