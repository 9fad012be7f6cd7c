"""The longest context on one GPU, predicted on fake tensors: Llama-3.1-8B- and Llama-3.2-1B-shaped full
fine-tunes without lightmem, then with each action added, beside the published figures (issue 59).

    python benchmarks/long_context.py                           # both shapes, H100 80 GiB and H200 140 GiB
    python benchmarks/long_context.py --model 1b --gpu h100     # one shape on one GPU
    python benchmarks/long_context.py --json rows.json          # the rows for programs too
    python benchmarks/long_context.py --measure                 # on a GPU: the 1B shape at its predicted longest context
    python benchmarks/long_context.py --tiny [--measure]        # a 2-layer shape at CPU prices: the code path in seconds

The models are LitGPT's configurations (``Config.from_name``, random weights on the meta device, nothing
downloaded), trained in bf16 (``precision="bf16-true"``: bf16 weights, gradients and AdamW state), one
sequence per step. Every figure is a prediction of ``lightmem.max_sequence_length`` at the GPU's table
prices (``lightmem.devices``), searched in multiples of 1,024 positions, with a 1 TiB host:

- without lightmem: the loss as LitGPT's fine-tuning writes it (the logits, then
  ``litgpt.utils.chunked_cross_entropy``);
- + chunked loss: ``lightmem.linear_cross_entropy`` from the hidden states (no logits);
- + checkpointing: every layer checkpointed;
- + offload of checkpointed inputs: what checkpointed layers keep (their inputs) offloaded to host;
- + tiling: the modules the trace finds position-wise (each layer's MLP and norms) in sequence shards;
- + optimizer offload: gradients and AdamW state on the host (``offload_optimizer``);
- lightmem's plan: what ``max_sequence_length`` chooses itself with every action allowed (its plan in
  words, its host memory, its time per token, and which memory stops it).

Each row's host memory is what its step holds on the host (offloaded activations and model state; for
the plan, its pool's bound too) and its time per token the predicted step over the sequence. The
published figures are other systems' measurements, on other stacks: Arctic Long Sequence Training
(ALST, arXiv 2506.13996), whose "plain" runs already checkpoint and keep parameters and optimizer on
the host (ZeRO-3 offload), with fp32 optimizer state; not the same configurations as the rows here.

``--measure`` (a GPU): predicts the 1B shape's longest context at this GPU's own measured speeds and
free memory, trains it there for a few steps with the plan (``LightMem(**plan.lightmem_kwargs())``),
and prints measured against predicted: peak reserved, step and time per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from _common import hardware, print_table  # noqa: E402

from lightmem import estimate_memory, linear_cross_entropy, max_sequence_length  # noqa: E402
from lightmem.config import format_bytes  # noqa: E402
from lightmem.estimate.words import format_seconds  # noqa: E402

MODELS = {"8b": "Llama-3.1-8B", "1b": "Llama-3.2-1B"}
GPUS = {"h100": ("h100", "80GiB"), "h200": ("h200", "140GiB")}
"""Table prices and the device memory of each GPU: an H100 80 GB's 80 GiB, an H200's 140 GiB (143,771 MiB
as nvidia-smi reports it, less the rounding)."""
HOST = "1TiB"
MULTIPLE = 1024
LIMIT = 1 << 23
"""The longest sequence searched: 8M positions."""
PRECISION = "bf16-true"
PUBLISHED = {
    ("8b", "h100"): {"without lightmem": "~32-36K (ALST, plain)", "lightmem's plan": "500K (ALST)"},
    ("8b", "h200"): {
        "without lightmem": "65K (ALST, plain)", "+ chunked loss": "300K (ALST, + tiled loss)",
        "+ offload of checkpointed inputs": "650K (ALST, + input offload)", "+ tiling": "1.2M (ALST, + TiledMLP)",
        "lightmem's plan": "1.2M (ALST)",
    },
}  # fmt: skip
"""Arctic Long Sequence Training's figures (arXiv 2506.13996; the issue's table), by the row they stand beside."""


def litgpt_model(name: str, *, tiny: bool = False, device: str = "meta") -> nn.Module:
    """LitGPT's ``name`` with random weights on ``device`` (``tiny``: 2 layers of width 64, for the CPU
    path). Its rope cache is made per step at the step's length (``hidden``): a model's buffers sized to
    the longest sequence searched would be counted at every length."""
    from litgpt.config import Config
    from litgpt.model import GPT

    small = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_query_groups": 2, "intermediate_size": 256, "padded_vocab_size": 512}
    with torch.device(device):
        model = GPT(Config.from_name(name, block_size=1024, **(small if tiny else {})))
    model.config.block_size = LIMIT  # the rope scaling is the config's own; only the cache's length changes
    model.max_seq_length = 1  # the buffers' rope cache; hidden() makes the step's own
    return model


def hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The final norm's output for token ids ``[B, T]``: LitGPT's forward without its head."""
    length = ids.shape[1]
    model._max_seq_length = length
    cos, sin = model.rope_cache(device=ids.device)
    cos, sin = cos.to(ids.device).unsqueeze(0), sin.to(ids.device).unsqueeze(0)
    x = model.transformer.wte(ids)
    for block in model.transformer.h:
        x = block(x, cos, sin, None, None)
    return model.transformer.ln_f(x)


def plain_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """LitGPT's fine-tuning loss: the logits, then its chunked cross-entropy."""
    from litgpt.utils import chunked_cross_entropy

    ids, targets = batch
    return chunked_cross_entropy(model.lm_head(hidden(model, ids)), targets)


def chunked_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss from the hidden states in chunks (``lightmem.linear_cross_entropy``): no logits."""
    ids, targets = batch
    return linear_cross_entropy(hidden(model, ids), model.lm_head.weight, targets)


def tokens(length: int, vocab: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of ``length`` positions: its token ids and each one's next token (random below ``vocab``)."""
    ids = torch.randint(0, vocab, (1, length + 1))
    return ids[:, :-1], ids[:, 1:]


@dataclass
class Row:
    model: str
    gpu: str
    label: str
    length: int
    host_bytes: int
    seconds_per_token: float | None
    plan: str
    limited_by: str = ""
    published: str = ""


def _steps(model: nn.Module, gpu: str, tiny: bool) -> list[tuple[str, Any, dict[str, Any]]]:
    """(label, loss, configuration) of each row before the plan's, each adding an action to the one before."""
    candidates = estimate_memory(model, tokens(256), chunked_loss, **_common(gpu, tiny)).tile_candidates
    offload = {"include": ["transformer.h.*"], "host_budget": HOST} if not tiny else None
    steps = [("without lightmem", plain_loss, {}), ("+ chunked loss", chunked_loss, {})]
    config: dict[str, Any] = {"checkpoint": ["Block"]}
    steps.append(("+ checkpointing", chunked_loss, dict(config)))
    if offload is not None:  # moving CPU memory to CPU memory saves nothing
        config["offload"] = offload
        steps.append(("+ offload of checkpointed inputs", chunked_loss, dict(config)))
    config["tile"] = candidates
    steps.append(("+ tiling", chunked_loss, dict(config)))
    config["offload_optimizer"] = True
    steps.append(("+ optimizer offload", chunked_loss, dict(config)))
    return steps


def _common(gpu: str, tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"device": "cpu", "precision": PRECISION}
    return {"device": "cuda", "gpu": GPUS[gpu][0], "precision": PRECISION}


def rows_for(key: str, gpu: str, *, tiny: bool = False, budget: str | None = None) -> list[Row]:
    """The rows of one shape on one GPU: each configuration's longest sequence, then the plan's."""
    model = litgpt_model(MODELS[key], tiny=tiny)
    budget = budget or GPUS[gpu][1]
    common = _common(gpu, tiny)
    rows = []
    gpu = "cpu" if tiny else gpu
    published = PUBLISHED.get((key, gpu), {})
    for label, loss, config in _steps(model, gpu, tiny):
        found = max_sequence_length(
            model, tokens(1024), budget, loss, plan=False, multiple_of=MULTIPLE, limit=LIMIT, **config, **common
        )  # fmt: skip
        length = found.configured if found.configured is not None else found.baseline
        host = per_token = None
        if length:
            estimate = estimate_memory(model, tokens(length), loss, **config, **common)
            host, per_token = estimate.scenarios[list(estimate.scenarios)[-1]].host_bytes, estimate.step_seconds / length
        rows.append(Row(key, gpu, label, length, host or 0, per_token, _words(config), published=published.get(label, "")))
        print(f"{MODELS[key]}, {gpu}: {label}: {length:,}", file=sys.stderr, flush=True)  # progress: a row takes minutes
    best = max_sequence_length(
        model, tokens(1024), budget, chunked_loss, multiple_of=MULTIPLE, limit=LIMIT,
        host_budget=HOST if not tiny else None, **common,
    )  # fmt: skip
    chosen = best.plan
    rows.append(Row(
        key, gpu, "lightmem's plan", best.planned or 0, chosen.host_total_bytes if chosen is not None else 0,
        best.seconds_per_token, "; ".join(chosen.parts()) if chosen is not None else "-", best.limited_by,
        published.get("lightmem's plan", ""),
    ))  # fmt: skip
    return rows


def _words(config: dict[str, Any]) -> str:
    words = []
    if config.get("checkpoint"):
        words.append("checkpoint every layer")
    if config.get("offload"):
        words.append("offload their inputs")
    if config.get("tile"):
        words.append(f"tile {len(config['tile'])} modules")
    if config.get("offload_optimizer"):
        words.append("offload_optimizer")
    return ", ".join(words) or "-"


def print_rows(rows: list[Row], title: str) -> None:
    cells = [
        [
            "tiny, cpu" if row.gpu == "cpu" else f"{MODELS[row.model]}, {row.gpu.upper()}", row.label, f"{row.length:,}", format_bytes(row.host_bytes) if row.host_bytes else "-",
            format_seconds(row.seconds_per_token) if row.seconds_per_token else "-", row.limited_by or "", row.published or "-",
            row.plan,
        ]
        for row in rows
    ]  # fmt: skip
    print_table(
        title, ["shape, GPU", "configuration", "longest (pred.)", "host", "per token (pred.)", "limit", "published", "what runs"],
        cells,
    )  # fmt: skip


# -- --measure ----------------------------------------------------------------------------------------


def measure(key: str, *, tiny: bool, steps: int = 3) -> dict[str, Any]:
    """The shape's longest context predicted for this machine's training device, then trained there
    for ``steps`` steps with the plan: measured against predicted (peak reserved on CUDA, step time)."""
    import pytorch_lightning as pl

    from lightmem import LightMem, measure_device_speeds

    cuda = torch.cuda.is_available() and not tiny
    device = "cuda" if cuda else "cpu"
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        budget, gpu = free, measure_device_speeds()
    else:
        budget, gpu = 24 << 20, "auto"
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = litgpt_model(MODELS[key], tiny=tiny, device="cpu")
            self.step_s: list[float] = []

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return chunked_loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            self._started = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.step_s.append(time.perf_counter() - self._started)

    module = Module()  # planned as it trains: its training_step, its optimizer
    best = max_sequence_length(
        module, tokens(256 if tiny else 1024), budget, device=device, gpu=gpu, precision=PRECISION,
        multiple_of=64 if tiny else MULTIPLE, limit=1 << 16 if tiny else LIMIT,
    )  # fmt: skip
    chosen, length = best.plan, best.planned or 0
    assert chosen is not None and chosen.fits, f"no plan fits: {best}"
    data = [tokens(length, module.model.config.padded_vocab_size)] * steps
    callback = LightMem(**chosen.lightmem_kwargs(), **({} if cuda else {"offload_devices": ["cpu"]}))
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, precision=PRECISION, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    step_s = sorted(module.step_s[1:] or module.step_s)[len(module.step_s[1:] or module.step_s) // 2]
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "length": length, "plan": "; ".join(chosen.parts()),
        "predicted_reserved_bytes": chosen.predicted_total_bytes, "measured_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "predicted_step_s": chosen.step_seconds, "measured_step_s": step_s,
        "predicted_per_token_s": best.seconds_per_token, "measured_per_token_s": step_s / length,
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--gpu", choices=[*GPUS, "all"], default="all")
    parser.add_argument("--json", metavar="PATH", help="also write the rows (or the measure) as JSON")
    parser.add_argument("--measure", action="store_true", help="train the 1B shape at its predicted longest context (a GPU)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer shape at CPU prices (the code path, in seconds)")
    args = parser.parse_args(argv)
    if args.measure and not args.tiny and not torch.cuda.is_available():
        parser.error("--measure trains on a GPU and this machine has none (--tiny --measure runs the CPU path)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        found = measure("1b", tiny=args.tiny)
        print(json.dumps(found, indent=2))
        if args.json:
            with open(args.json, "w") as file:
                json.dump(found, file, indent=2)
        return
    started = time.perf_counter()
    rows: list[Row] = []
    for key in MODELS if args.model == "all" else [args.model]:
        for gpu in GPUS if args.gpu == "all" else [args.gpu]:
            rows += rows_for(key, gpu, tiny=args.tiny, budget="24MiB" if args.tiny else None)
            if args.tiny:  # one shape at CPU prices: the code path
                break
        if args.tiny:
            break
    where = "CPU prices, 24 MiB" if args.tiny else f"table prices, {HOST} host"
    print_rows(rows, f"Longest context, predicted on fake tensors ({where}; {PRECISION}; computed on {hardware()} in {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(row) for row in rows], file, indent=2)


if __name__ == "__main__":
    main()
