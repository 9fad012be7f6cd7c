"""Hugging Face models as a new user builds them: small sizes, every other config value at its default.

Nothing is downloaded: each model is built from its config with random weights. ``use_cache`` stays
at its default (True), and dropout at the family's default (GPT-2 and T5: 0.1).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB, BATCH, SEQ = 128, 2, 16
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "t5")
BLOCKS = {
    "gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer", "t5": "T5Block", "mixtral": "MixtralDecoderLayer",
}  # fmt: skip

_DECODER = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=VOCAB)  # fmt: skip


def default_model(kind: str, seed: int = 0) -> nn.Module:
    """A 2-layer, width-64 model of the family, in train mode, from an otherwise default config."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**_DECODER))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DECODER))
    elif kind == "t5":
        # decoder_start_token_id has no default in transformers 5; T5's own checkpoints use 0.
        config = transformers.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32, vocab_size=VOCAB,
            decoder_start_token_id=0,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
    elif kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**_DECODER))
    else:
        raise KeyError(kind)
    return model.train()


def default_batch(kind: str, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    if kind == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}


def self_attention_keys(cache) -> list[torch.Tensor]:
    """Every layer's cached keys (the self-attention part of an encoder-decoder cache)."""
    cache = getattr(cache, "self_attention_cache", cache)
    return [layer.keys for layer in cache.layers]
