"""Where a predicted step's time goes, op by op, beside the profiler's measured device time.

The planner prices every op of a fake step by its class (``lightmem.devices.op_cost``): products
and convolutions at the matrix rate of their dtype, the rest by their bytes at the memory
bandwidth. This prints, for each ``aten`` op, the predicted seconds (``MemoryEstimate.op_seconds``)
and, on a GPU, the device time the profiler saw (``self_device_time_total`` of ``aten::<op>``),
so a mispriced class shows up as a column of ratios rather than one step-time error.

    python benchmarks/op_prices.py                    # predictions priced for an H100 (any machine)
    python benchmarks/op_prices.py --measure          # on a GPU: its own speeds, and the profiler beside
    python benchmarks/op_prices.py --models gpt --json-out prices.json

Models: the GPT of the GPU runs (16 pre-norm blocks, dim 1024, 16 heads, 1024 tokens, vocab 32000,
SDPA) at batch 8, bf16 autocast, fused AdamW; ResNet-50 (torchvision's layout, 224 x 224) at batch
64, fp32, SGD with momentum; GPT-2 from ``transformers.GPT2Config()`` at batch 3 (the frontier's
reference batch under 8 GiB), bf16 autocast, AdamW.

The last row compares the host's time to issue one step (from a synchronised device to the step's
return, the median of the timed steps) with the price of it (``host_op_s`` per priced op): a step
whose host time reaches its device time is bound by the host, and its device time per op is then
not what decides it. On the H100 GPT-2's frontier rows ran 1.2-2.2x their device prices with
steps that varied by 20% (docs/gpu-runs/2026-11-27-h100-frontier.txt): this row says whether the
host is why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "examples"))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))

from _common import hardware  # noqa: E402
from estimate_factories import ResNet, classification_loss  # noqa: E402
from plans_hold import GPT_CONFIG, fused_adamw, gpt_loss, gpt_module  # noqa: E402

from lightmem import estimate_memory  # noqa: E402
from lightmem.devices import cuda_seconds, measure_device_speeds  # noqa: E402
from lightmem.tables import format_table  # noqa: E402

SHOWN = 24
"""Ops shown one per row, the costliest first; the rest are summed in one row."""


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _gpt_case(batch: int = 8) -> dict[str, Any]:
    return {
        "title": f"GPT {GPT_CONFIG}, batch {batch}, bf16 autocast, fused AdamW",
        "model": gpt_module, "loss_fn": gpt_loss, "optimizer": fused_adamw, "precision": "bf16-mixed",
        "batch": lambda device: torch.randint(0, int(GPT_CONFIG["vocab"]), (batch, int(GPT_CONFIG["seq"]) + 1), device=device),
    }  # fmt: skip


def _resnet_case(batch: int = 64) -> dict[str, Any]:
    def images(device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, 224, 224, device=device), torch.randint(0, 1000, (batch,), device=device)

    return {
        "title": f"ResNet-50, batch {batch}, fp32, SGD with momentum",
        "model": ResNet, "loss_fn": classification_loss, "optimizer": _sgd, "precision": "32-true", "batch": images,
    }  # fmt: skip


def _gpt2_case(batch: int = 3) -> dict[str, Any]:
    import transformers
    import torch.nn.functional as F

    transformers.logging.set_verbosity_error()

    def loss_fn(model: Any, ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return {
        "title": f"GPT-2 (transformers.GPT2Config()), batch {batch}, bf16 autocast, AdamW",
        "model": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()), "loss_fn": loss_fn,
        "optimizer": torch.optim.AdamW, "precision": "bf16-mixed",
        "batch": lambda device: torch.randint(0, 50257, (batch, 1024), device=device),
    }  # fmt: skip


CASES: dict[str, Callable[[], dict[str, Any]]] = {"gpt": _gpt_case, "resnet50": _resnet_case, "gpt2": _gpt2_case}


def predicted(case: dict[str, Any], gpu: Any) -> dict[str, Any]:
    """The estimate's op prices and step time (fake tensors: no device memory is used)."""
    with torch.device("meta"):
        model = case["model"]()
        batch = case["batch"]("meta")
    estimate = estimate_memory(
        model, batch, case["loss_fn"], optimizer=case["optimizer"], precision=case["precision"], device="cuda", gpu=gpu
    )  # fmt: skip
    return {
        "ops": {name: seconds for name, (seconds, _) in estimate.op_seconds.items()},
        "calls": {name: calls for name, (_, calls) in estimate.op_seconds.items()},
        "step_s": estimate.scenarios["baseline"].step_seconds,
        "host_s": estimate.speeds.host_seconds(estimate.priced_ops) if estimate.speeds is not None else 0.0,
        "speeds": estimate.speeds.describe() if estimate.speeds is not None else "",
    }


def measured(case: dict[str, Any], steps: int = 5, profiled: int = 2) -> dict[str, Any]:
    """The real step on this GPU: median step time (events) and the profiler's device time per op."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = case["model"]().to(device)
    optimizer = case["optimizer"](model.parameters())
    batch = case["batch"](device)
    autocast = case["precision"] == "bf16-mixed"

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = case["loss_fn"](model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = [cuda_seconds(step) for _ in range(steps)]
    host = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        host.append(time.perf_counter() - started)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    ops: dict[str, float] = {}
    for event in profiler.key_averages():
        if not event.key.startswith("aten::"):
            continue
        micro = getattr(event, "self_device_time_total", None)
        if micro is None:
            micro = event.self_cuda_time_total
        if micro:
            ops[event.key.removeprefix("aten::")] = micro / 1e6 / profiled
    del model, optimizer, batch
    torch.cuda.empty_cache()
    return {"ops": ops, "step_s": statistics.median(times), "steps_s": times, "host_s": statistics.median(host)}


def rows(prediction: dict[str, Any], measurement: dict[str, Any] | None) -> list[list[str]]:
    """One row per op (the costliest ``SHOWN``), then the rest, then the totals."""
    seen = measurement["ops"] if measurement else {}
    names = sorted(set(prediction["ops"]) | set(seen), key=lambda n: -max(prediction["ops"].get(n, 0.0), seen.get(n, 0.0)))

    def row(name: str, p: float, m: float | None, calls: Any) -> list[str]:
        ratio = f"{m / p:.2f}x" if m is not None and p > 0 else "-"
        return [name, str(calls), f"{p * 1e3:.2f}", "-" if m is None else f"{m * 1e3:.2f}", ratio]

    out = [row(n, prediction["ops"].get(n, 0.0), seen.get(n) if measurement else None, prediction["calls"].get(n, 0))
           for n in names[:SHOWN]]  # fmt: skip
    rest = names[SHOWN:]
    if rest:
        out.append(row(f"({len(rest)} other ops)", sum(prediction["ops"].get(n, 0.0) for n in rest),
                       sum(seen.get(n, 0.0) for n in rest) if measurement else None, ""))  # fmt: skip
    out.append(row("all ops (device time)", sum(prediction["ops"].values()),
                   sum(seen.values()) if measurement else None, sum(prediction["calls"].values())))  # fmt: skip
    out.append(row("the step (predicted / measured wall)", prediction["step_s"],
                   measurement["step_s"] if measurement else None, ""))  # fmt: skip
    out.append(row("the host issuing the step (priced / measured)", prediction["host_s"],
                   measurement["host_s"] if measurement else None, ""))  # fmt: skip
    return out


HEADERS = ["op", "calls (predicted)", "predicted ms", "measured ms", "measured / predicted"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--gpu", default="h100", help="the table's GPU to price for, without --measure")
    parser.add_argument("--measure", action="store_true", help="price at this GPU's measured speeds and profile the real step")
    parser.add_argument("--json-out", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.measure and not torch.cuda.is_available():
        print("op_prices: no CUDA device here: nothing to measure (run without --measure for the predictions)")
        return 0
    gpu: Any = measure_device_speeds("cuda") if args.measure else args.gpu
    results = {}
    for name in args.models:
        case = CASES[name]()
        prediction = predicted(case, gpu)
        measurement = measured(case) if args.measure else None
        results[name] = {"title": case["title"], "predicted": prediction, "measured": measurement}
        where = "measured on this GPU" if args.measure else f"predicted for {args.gpu}"
        print(format_table(rows(prediction, measurement), HEADERS,
                           title=f"{case['title']}: {where} ({hardware()}); priced at {prediction['speeds']}"), flush=True)  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
