"""The frontier, predicted: for batch multiples of the largest batch that fits without lightmem, the
best plan's time per sample against that batch and against the device's floor.

Three models, each under a stated device budget, priced for an H100 (``gpu="h100"``, the table's
figures; with expandable segments, as ``plan="auto"`` sets them):

- the GPT of the GPU runs (16 pre-norm blocks, dim 1024, 16 heads, 1024 tokens, vocab 32000, SDPA),
  bf16-mixed, fused AdamW, 16 GiB;
- ResNet-50 (torchvision's layout, fp32, SGD with momentum, 224 x 224), 12 GiB;
- GPT-2 from ``transformers.GPT2Config()`` (its defaults: 12 layers, 768 wide, 1024 positions),
  bf16-mixed, AdamW, 8 GiB.

    python benchmarks/frontier.py                 # every model (fake tensors: any machine, ~10 min on 2 cores)
    python benchmarks/frontier.py --models gpt    # one of gpt, resnet50, gpt2
    python benchmarks/frontier.py --json          # the tables as JSON

On a GPU, ``benchmarks/plans_hold.py --measure`` measures ``LightMem(plan="auto")`` at the GPT's
1x, 1.5x and 2x (and 5x, 8x) beside these predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "examples"))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))

from _common import hardware  # noqa: E402
from estimate_factories import resnet50  # noqa: E402
from plans_hold import _meta_model, fused_adamw, gpt_loss  # noqa: E402

from lightmem import frontier  # noqa: E402


def _gpt() -> dict[str, Any]:
    tokens = torch.zeros(8, 1025, dtype=torch.long)
    return {"model": _meta_model(), "batch": tokens, "loss_fn": gpt_loss, "budget": "16GiB",
            "optimizer": fused_adamw, "precision": "bf16-mixed"}  # fmt: skip


def _resnet50() -> dict[str, Any]:
    model, batch, loss_fn = resnet50(32)
    return {"model": model, "batch": batch, "loss_fn": loss_fn, "budget": "12GiB",
            "optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "precision": "32-true"}  # fmt: skip


def _gpt2() -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    ids = torch.zeros(4, 1024, dtype=torch.long)

    def loss_fn(model: Any, batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return {"model": model, "batch": ids, "loss_fn": loss_fn, "budget": "8GiB", "optimizer": "adamw",
            "precision": "bf16-mixed"}  # fmt: skip


MODELS = {"gpt": _gpt, "resnet50": _resnet50, "gpt2": _gpt2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="PNG", help="also draw time per sample against batch size (needs matplotlib)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    found = {}
    for name in args.models:
        case = MODELS[name]()
        result = frontier(
            case["model"], case["batch"], case["budget"], case["loss_fn"], optimizer=case["optimizer"],
            precision=case["precision"], device="cuda", gpu=args.gpu,
        )  # fmt: skip
        found[name] = result
        if not args.json:
            print(f"{name}: predicted on {hardware()} (fake tensors), in {result.seconds:.0f} s")
            result.print()
            print()
    if args.json:
        print(json.dumps({name: result.to_dict() for name, result in found.items()}, indent=2))
    if args.plot:
        plot(found, args.plot, args.gpu)
    return 0


def plot(found: dict[str, Any], path: str, gpu: str) -> None:
    """Time per sample against the reference's (1.0), by batch size over the reference, with the
    floor: one line per model. matplotlib is not a dependency of lightmem: install it to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for (name, result), colour in zip(found.items(), ("tab:blue", "tab:orange", "tab:green")):
        rows = [row for row in result.rows if row.fits]
        reference = max(result.reference_batch, 1)
        sizes = [row.batch_size / reference for row in rows]
        axes.plot(sizes, [row.vs_reference for row in rows], "o-", color=colour, label=f"{name}: best plan")
        axes.plot(sizes, [row.floor_vs_reference for row in rows], "--", color=colour, alpha=0.6, label=f"{name}: floor")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel("batch size / largest batch without lightmem")
    axes.set_ylabel("time per sample / without lightmem")
    axes.set_yscale("log")
    axes.set_title(f"The frontier, predicted for an {gpu.upper()} (fake tensors)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
