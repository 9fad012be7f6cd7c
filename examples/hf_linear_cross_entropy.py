"""A Hugging Face causal LM's own loss without its full logits: ``lightmem.chunked_causal_lm_loss``.

    python examples/hf_linear_cross_entropy.py

With a large vocabulary the peak of a training step is often the loss: ``model(labels=...)``
makes logits of shape (tokens, vocabulary), a float32 copy, their log-softmax and, in backward,
gradients of the same size. lightmem's estimator says so (advice ``loss-logits``).
``lightmem.chunked_causal_lm_loss(model)`` (``LightMem(chunked_loss=True)`` in a Lightning fit)
makes the model's own loss ``lightmem.linear_cross_entropy`` over its hidden states, in chunks,
so the logits are never made; the training step does not change. This script checks that the
loss and gradients are the model's own (to float32 rounding: the chunks sum in another order)
and prints the estimator's peak of both (a tiny GPT-2 with a 32k vocabulary, estimated for CUDA).

It runs on CPU in a few seconds; nothing is downloaded.
"""

from __future__ import annotations

import torch
import transformers

import lightmem
from lightmem import estimate_memory


def hf_loss(model: transformers.PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def chunked_loss(model: transformers.PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(**batch).loss``, with the model's loss chunked for this one call."""
    handle = lightmem.chunked_causal_lm_loss(model)
    try:
        return hf_loss(model, batch)
    finally:
        handle.remove()


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

    # Dropout off so that both losses see the same network (the chunked loss changes only a training
    # forward with labels: train mode is kept, dropout's probability set to 0).
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = hf_loss(model, batch)
    expected = gradients(model, reference)
    chunked = chunked_loss(model, batch)
    actual = gradients(model, chunked)
    loss_diff = abs(reference.item() - chunked.item())
    grad_diff = max((expected[name] - actual[name]).abs().max().item() for name in expected)
    grad_scale = max(expected[name].abs().max().item() for name in expected)
    print(f"loss: model(labels=...) {reference.item():.6f}, chunked {chunked.item():.6f}")
    print(f"largest difference: loss {loss_diff:.2e}, gradients {grad_diff:.2e} (largest gradient {grad_scale:.2e})")
    assert expected.keys() == actual.keys()
    assert loss_diff <= 1e-5 * abs(reference.item()), "losses differ beyond float32 rounding"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    print("loss and gradients match (rtol 1e-4, atol 1e-6)")

    before = estimate_memory(model, batch, hf_loss, device="cuda")
    after = estimate_memory(model, batch, chunked_loss, device="cuda")
    print(f"estimated peak on CUDA: model(labels=...) {before.peak_bytes / 2**20:.1f} MiB, "
          f"chunked {after.peak_bytes / 2**20:.1f} MiB")  # fmt: skip
    for item in before.advice:
        if item.rule == "loss-logits":
            print(f"advice [{item.rule}]: {item.message}")


if __name__ == "__main__":
    main()
