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

    python benchmarks/frontier.py --measure       # on a GPU: each row's plan run, time per sample beside

``--measure`` runs, on this machine's GPU with its own measured speeds and the caching allocator
capped at the budget (``set_per_process_memory_fraction``, expandable segments), every row that
fits: a fresh model, the row's plan applied (``apply_checkpointing`` and ``offload_activations``
with the plan's flags, host memory page-locked first), two warm-up steps, then the median of
``--steps`` steps timed with CUDA events; the measured time per sample beside the predicted one, and
whether the step is within 15% of its prediction (issue 38). ``benchmarks/plans_hold.py --measure``
runs ``LightMem(plan="auto")`` itself at the GPT's 1x, 1.5x and 2x (and 5x, 8x).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "examples"))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))

from _common import hardware, run_script  # noqa: E402
from estimate_factories import resnet50  # noqa: E402
from plans_hold import _meta_model, fused_adamw, gpt_loss  # noqa: E402

from lightmem import apply_checkpointing, frontier, measure_device_speeds, offload_activations  # noqa: E402
from lightmem.devices import cuda_seconds  # noqa: E402
from lightmem.config import parse_size  # noqa: E402
from lightmem.estimate.report import format_seconds  # noqa: E402
from lightmem.tables import format_table  # noqa: E402

WITHIN = 0.15
"""How close a measured step must be to its prediction (issue 38)."""


def _gpt() -> dict[str, Any]:
    from plans_hold import gpt_module

    tokens = torch.zeros(8, 1025, dtype=torch.long)
    return {"model": _meta_model(), "batch": tokens, "loss_fn": gpt_loss, "budget": "16GiB",
            "optimizer": fused_adamw, "precision": "bf16-mixed", "real": gpt_module,
            "make_batch": lambda n, device: torch.randint(0, 32000, (n, 1025), device=device)}  # fmt: skip


def _resnet50() -> dict[str, Any]:
    from estimate_factories import ResNet

    model, batch, loss_fn = resnet50(32)

    def images(n: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 224, 224, device=device), torch.randint(0, 1000, (n,), device=device)

    return {"model": model, "batch": batch, "loss_fn": loss_fn, "budget": "12GiB",
            "optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "precision": "32-true",
            "real": ResNet, "make_batch": images}  # fmt: skip


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
            "precision": "bf16-mixed", "real": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()),
            "make_batch": lambda n, device: torch.randint(0, 50257, (n, 1024), device=device)}  # fmt: skip


def apply_plan(model: torch.nn.Module, chosen: Any) -> tuple[Any, Any]:
    """``chosen``'s checkpointing and activation offload on a plain module (what ``LightMem`` does
    from ``lightmem_kwargs()``): (checkpoint handle or None, offloader or None)."""
    handle = None
    if chosen.checkpoint:
        handle = apply_checkpointing(model, list(chosen.checkpoint), policy=chosen.checkpoint_policy)
    offloader = None
    if chosen.offload is not None:
        offload = chosen.offload
        offloader = offload_activations(
            model, min_bytes=offload.min_bytes, include=offload.include_arg(),
            exclude=list(offload.exclude) if offload.exclude else None, prefetch=offload.prefetch_bytes,
            max_inflight_bytes=offload.max_inflight_bytes,
        )  # fmt: skip
    return handle, offloader


def _optimizer(case: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    made = case["optimizer"]
    return torch.optim.AdamW(params) if made == "adamw" else made(params)


def measure_row(case: dict[str, Any], chosen: Any, batch: int, steps: int) -> dict[str, Any]:
    """The median step (CUDA events) of ``chosen`` at ``batch`` on this GPU, after two warm-ups."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = case["real"]().to(device)
    optimizer = _optimizer(case, model.parameters())
    inputs = case["make_batch"](batch, device)
    handle, offloader = apply_plan(model, chosen)
    if offloader is not None and chosen.host_bytes:
        offloader.prepare_host(chosen.host_bytes, wait=True)
    autocast = case["precision"] == "bf16-mixed"
    times: list[float] = []
    torch.cuda.reset_peak_memory_stats(device)
    def step() -> None:
        with offloader if offloader is not None else contextlib.nullcontext():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = case["loss_fn"](model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        times = [cuda_seconds(step) for _ in range(2 + steps)][2:]  # two warm-ups
        outcome = "ran"
    except torch.cuda.OutOfMemoryError:
        outcome = "OUT OF MEMORY"
    finally:
        peak = torch.cuda.max_memory_reserved(device)
        if handle is not None:
            handle.remove()
        if offloader is not None:
            offloader.release_host_memory()
        del model, optimizer, inputs
        gc.collect()
        torch.cuda.empty_cache()
    return {"outcome": outcome, "steps_s": times, "step_s": statistics.median(times) if times else None, "reserved": peak}


def measure(name: str, steps: int = 4, deadline: float = float("inf")) -> tuple[Any, list[dict[str, Any]]]:
    """``name``'s frontier priced at this GPU's measured speeds, then each row that fits run."""
    case = MODELS[name]()
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(case["budget"], flag="budget") / total), device)
    speeds = measure_device_speeds(device)
    result = frontier(
        case["model"], case["batch"], case["budget"], case["loss_fn"], optimizer=case["optimizer"],
        precision=case["precision"], device="cuda", gpu=speeds,
    )  # fmt: skip
    measured = []
    for row in result.rows:
        if not row.fits or time.monotonic() > deadline:
            measured.append({"outcome": "does not fit" if not row.fits else "not run (time limit)"})
            continue
        measured.append(measure_row(case, result.plans[row.batch_size], row.batch_size, steps))
        print(json.dumps({"progress": name, "batch": row.batch_size, **measured[-1]}, default=str), flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    return result, measured


def measured_table(result: Any, measured: list[dict[str, Any]]) -> str:
    """Predicted beside measured, per row; the verdict line says which steps are within 15%."""
    rows, off = [], []
    for row, got in zip(result.rows, measured):
        step = got.get("step_s")
        ratio = step / row.step_s if step and row.fits else None
        if ratio is not None and abs(ratio - 1) > WITHIN:
            off.append(f"{row.batch_size} ({ratio:.2f}x)")
        rows.append([
            f"{row.batch_size} ({row.label})", row.plan if row.fits else "does not fit",
            format_seconds(row.per_sample_s) if row.fits else "-",
            format_seconds(step / row.batch_size) if step else got["outcome"],
            f"{ratio:.2f}x" if ratio is not None else "-",
        ])  # fmt: skip
    headers = ["batch", "plan", "predicted per sample", "measured per sample", "measured / predicted step"]
    verdict = "every measured step within 15% of its prediction" if not off else "off by more than 15%: " + ", ".join(off)
    return format_table(rows, headers, title=f"Priced at {result.speeds.describe()}") + f"\nVerdict: {verdict}\n"


MODELS = {"gpt": _gpt, "resnet50": _resnet50, "gpt2": _gpt2}


def selfcheck_section(limit_s: float = 900.0) -> str:
    """Markdown for ``python -m lightmem.selfcheck`` (its full run, or ``--sections frontier``): the
    measured frontier of every model, in a child process killed at ``limit_s`` (output kept)."""
    if not torch.cuda.is_available():
        return "## The frontier, measured\n\nNo CUDA device: nothing to measure.\n"
    output, error, code = run_script(__file__, ["--measure", "--time-limit-s", str(max(limit_s - 120, 1))], limit_s - 5)
    verdict = error if code is None else "finished" if code == 0 else f"exit code {code}"
    lines = [line for line in output.splitlines() if not line.startswith("{")]
    verdicts = [line.removeprefix("Verdict: ") for line in lines if line.startswith("Verdict: ")]
    summary = "; ".join(verdicts) if verdicts else verdict
    return "## The frontier, measured\n\n**Verdict:** " + summary + "\n\n```\n" + "\n".join(lines) + "\n```\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="PNG", help="also draw time per sample against batch size (needs matplotlib)")
    parser.add_argument("--measure", action="store_true", help="run each row's plan on this machine's GPU")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row with --measure (default 4)")
    parser.add_argument("--time-limit-s", type=float, default=float("inf"), help="with --measure: rows after this are not run")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.measure:
        if not torch.cuda.is_available():
            print("frontier: no CUDA device here: nothing to measure (run without --measure for the predictions)")
            return 0
        deadline = time.monotonic() + args.time_limit_s
        for name in args.models:
            result, measured = measure(name, args.steps, deadline)
            print(f"{name}: measured on {hardware()}")
            print(measured_table(result, measured))
        return 0
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
