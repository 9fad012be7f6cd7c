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

    python benchmarks/frontier.py --gpu docs/gpu-runs/2026-11-27-h100-speeds.json   # priced at a GPU's measured speeds

    python benchmarks/frontier.py --measure       # on a GPU: each row's plan run, time per sample beside
    python benchmarks/frontier.py --gpu SPEEDS.json --save-plans PLANS.json   # plan here, on any machine ...
    python benchmarks/frontier.py --measure --plans PLANS.json               # ... and run those plans on the GPU

``--measure`` runs, on this machine's GPU with its own measured speeds and the caching allocator
capped at the budget (``set_per_process_memory_fraction``, expandable segments), every row that
fits: a fresh model, the row's plan applied (``apply_checkpointing`` and ``offload_activations``
with the plan's flags, host memory page-locked first), two warm-up steps, then the median of
``--steps`` steps timed with CUDA events; the measured time per sample beside the predicted one, and
whether the step is within 15% of its prediction (issue 38). Planning the three frontiers takes
minutes of one CPU core (fake-tensor dry runs and the plan search); with ``--plans`` a GPU lent for
minutes spends none of them on it: the rows and plans come from a file ``--save-plans`` wrote, priced
at speeds this kind of GPU measured (``--gpu FILE``, a ``DeviceSpeeds.to_dict()``), and the speeds
measured now are printed beside them. ``benchmarks/plans_hold.py --measure``
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "examples"))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))

from _common import hardware, run_script  # noqa: E402
from estimate_factories import resnet50  # noqa: E402
from plans_hold import GPT2_CAP, _gpt2_ids, _meta_gpt2, _meta_model, fused_adamw, gpt2_loss, gpt_loss  # noqa: E402

from lightmem import apply_checkpointing, frontier, measure_device_speeds, offload_activations  # noqa: E402
from lightmem.config import format_bytes  # noqa: E402
from lightmem.devices import DeviceSpeeds, cuda_seconds  # noqa: E402
from lightmem.estimate.frontier import Frontier, FrontierRow, measured_rows  # noqa: E402
from lightmem.estimate.words import format_seconds  # noqa: E402
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

    ids = torch.zeros(4, 1024, dtype=torch.long)
    return {"model": _meta_gpt2(), "batch": ids, "loss_fn": gpt2_loss, "budget": GPT2_CAP, "optimizer": "adamw",
            "precision": "bf16-mixed", "real": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()),
            "make_batch": _gpt2_ids}  # fmt: skip


def apply_plan(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A plan's checkpointing and activation offload on a plain module, from its
    ``lightmem_kwargs()`` (what ``LightMem(**kwargs)`` applies): (checkpoint handle or None,
    offloader or None). Only the keys a plan writes are accepted."""
    known = {"offload", "offload_min_bytes", "offload_include", "offload_exclude", "prefetch_bytes",
             "offload_max_inflight_bytes", "checkpoint", "checkpoint_policy"}  # fmt: skip
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"apply_plan: this benchmark does not apply {', '.join(unknown)}")
    handle = None
    if kwargs.get("checkpoint"):
        handle = apply_checkpointing(model, list(kwargs["checkpoint"]), policy=kwargs.get("checkpoint_policy", "full"))
    offloader = None
    if kwargs.get("offload"):
        offloader = offload_activations(
            model, min_bytes=kwargs["offload_min_bytes"], include=kwargs.get("offload_include"),
            exclude=kwargs.get("offload_exclude"), prefetch=kwargs["prefetch_bytes"],
            max_inflight_bytes=kwargs["offload_max_inflight_bytes"],
        )  # fmt: skip
    return handle, offloader


def _optimizer(case: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    made = case["optimizer"]
    return torch.optim.AdamW(params) if made == "adamw" else made(params)


def measure_row(
    case: dict[str, Any], kwargs: dict[str, Any], host_bytes: int, batch: int, steps: int,
    device: torch.device | None = None, timer: Any = cuda_seconds,
) -> dict[str, Any]:
    """The median step (``timer``: CUDA events) of the plan ``kwargs`` (``lightmem_kwargs()``) at
    ``batch`` on ``device`` (default: this GPU), after two warm-ups, with ``host_bytes``
    page-locked before the first. A step that fails (out of memory, or anything else) is reported
    as its outcome; the next row still runs."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    times: list[float] = []
    handle = offloader = model = optimizer = inputs = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        torch.manual_seed(0)
        model = case["real"]().to(device)
        optimizer = _optimizer(case, model.parameters())
        inputs = case["make_batch"](batch, device)
        handle, offloader = apply_plan(model, kwargs)
        if offloader is not None and host_bytes:
            offloader.prepare_host(host_bytes, wait=True)
        autocast = case["precision"] == "bf16-mixed"

        def step() -> None:
            with offloader if offloader is not None else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = case["loss_fn"](model, inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        times = [timer(step) for _ in range(2 + steps)][2:]  # two warm-ups
        outcome = "ran"
    except torch.cuda.OutOfMemoryError:
        outcome = "OUT OF MEMORY"
    except Exception as error:  # noqa: BLE001 - one row's failure is its outcome, not the run's end
        outcome = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    finally:
        if handle is not None:
            handle.remove()
        if offloader is not None:
            offloader.release_host_memory()
        model = optimizer = inputs = None
        gc.collect()
        peak = torch.cuda.max_memory_reserved(device) if cuda else None
        if cuda:
            torch.cuda.empty_cache()
    return {"outcome": outcome, "steps_s": times, "step_s": statistics.median(times) if times else None, "reserved": peak}


@dataclass
class Planned:
    """One model's frontier as measured here: its rows, the speeds they were priced at, and per row
    the plan's ``lightmem_kwargs()`` and the host bytes it predicts (by batch size)."""

    rows: list[FrontierRow]
    speeds: DeviceSpeeds
    kwargs: dict[int, dict[str, Any]]
    host_bytes: dict[int, int]
    budget_bytes: int
    reference_batch: int
    largest_batch: int

    @classmethod
    def of(cls, result: Frontier) -> Planned:
        assert result.speeds is not None
        fitting = {size: chosen for size, chosen in result.plans.items() if chosen.fits}  # a plan that does not fit has no flags
        kwargs = {size: chosen.lightmem_kwargs() for size, chosen in fitting.items()}
        host = {size: chosen.host_bytes for size, chosen in fitting.items()}
        return cls(result.rows, result.speeds, kwargs, host, result.budget_bytes, result.reference_batch, result.largest_batch)

    def to_dict(self) -> dict[str, Any]:
        rows = [
            {**row.to_dict(), "reference_per_sample_seconds": row.reference_per_sample_s,
             "lightmem_kwargs": self.kwargs.get(row.batch_size), "host_bytes": self.host_bytes.get(row.batch_size)}
            for row in self.rows
        ]  # fmt: skip
        return {"budget_bytes": self.budget_bytes, "reference_batch": self.reference_batch,
                "largest_batch": self.largest_batch, "speeds": self.speeds.to_dict(), "rows": rows}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Planned:
        rows = [
            FrontierRow(row["batch_size"], row["label"], row["fits"], row["plan"], row["predicted_total_bytes"],
                        row["step_seconds"] or 0.0, row["floor_seconds"] or 0.0,  # None: does not fit
                        row["reference_per_sample_seconds"])
            for row in data["rows"]
        ]  # fmt: skip
        kwargs = {row["batch_size"]: row["lightmem_kwargs"] for row in data["rows"] if row["lightmem_kwargs"] is not None}
        host = {row["batch_size"]: row["host_bytes"] for row in data["rows"] if row["lightmem_kwargs"] is not None}
        return cls(rows, DeviceSpeeds.from_dict(data["speeds"]), kwargs, host, data["budget_bytes"],
                   data["reference_batch"], data["largest_batch"])  # fmt: skip


def plan_frontier(name: str, gpu: Any) -> Frontier:
    """``name``'s frontier (fake tensors) priced at ``gpu``: a table name, or ``DeviceSpeeds``."""
    case = MODELS[name]()
    return frontier(
        case["model"], case["batch"], case["budget"], case["loss_fn"], optimizer=case["optimizer"],
        precision=case["precision"], device="cuda", gpu=gpu,
    )  # fmt: skip


def measure(
    name: str, steps: int = 4, deadline: float = float("inf"), planned: Planned | None = None
) -> tuple[Planned, list[dict[str, Any]], DeviceSpeeds]:
    """``name``'s frontier (``planned``, else planned here at this GPU's measured speeds), then each
    row that fits run: (the frontier, one measurement per row, the speeds measured here)."""
    case = MODELS[name]()
    device = torch.device("cuda", torch.cuda.current_device())
    speeds = measure_device_speeds(device)
    if planned is None:
        planned = Planned.of(plan_frontier(name, speeds))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, planned.budget_bytes / total), device)
    measured = []
    for row in planned.rows:
        if not row.fits or time.monotonic() > deadline:
            measured.append({"outcome": "does not fit" if not row.fits else "not run (time limit)"})
            continue
        kwargs = planned.kwargs[row.batch_size]
        measured.append(measure_row(case, kwargs, planned.host_bytes.get(row.batch_size, 0), row.batch_size, steps))
        print(json.dumps({"progress": name, "batch": row.batch_size, **measured[-1]}, default=str), flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    return planned, measured, speeds


def measured_table(result: Any, measured: list[dict[str, Any]], speeds_here: DeviceSpeeds | None = None) -> str:
    """Predicted beside measured, per row (the step time per sample, the reserved peak against the
    predicted total); the verdict line says which steps are within 15%."""
    rows, off = [], []
    steps = {row.batch_size: got["step_s"] for row, got in zip(result.rows, measured) if got.get("step_s")}
    for row, got in zip(measured_rows(result.rows, steps), measured):
        step = got.get("step_s")
        ratio = step / row.step_s if step and row.fits else None
        if ratio is not None and abs(ratio - 1) > WITHIN:
            off.append(f"{row.batch_size} ({ratio:.2f}x)")
        reserved = got.get("reserved")
        vs_reference, vs_floor = row.measured_vs_reference, row.measured_vs_floor
        rows.append([
            f"{row.batch_size} ({row.label})", row.plan if row.fits else "does not fit",
            format_seconds(row.per_sample_s) if row.fits else "-",
            format_seconds(step / row.batch_size) if step else got["outcome"],
            f"{ratio:.2f}x" if ratio is not None else "-",
            f"{vs_reference:.2f}x ({row.vs_reference:.2f}x)" if vs_reference is not None else "-",
            f"{vs_floor:.2f}x" if vs_floor is not None else "-",
            f"{format_bytes(reserved)} of {format_bytes(row.predicted_total_bytes)}" if reserved else "-",
        ])  # fmt: skip
    headers = ["batch", "plan", "predicted per sample", "measured per sample", "measured / predicted step",
               "per sample vs 1x, measured (predicted)", "measured / floor at the measured pace",
               "peak reserved of predicted"]  # fmt: skip
    ran = [got for got in measured if got.get("step_s")]
    failed = [f"{row.batch_size} ({got['outcome']})" for row, got in zip(result.rows, measured)
              if row.fits and not got.get("step_s") and not got["outcome"].startswith("not run")]  # fmt: skip
    if not ran:
        verdict = "no row ran"
    elif off:
        verdict = "off by more than 15%: " + ", ".join(off)
    else:
        verdict = f"every measured step within 15% of its prediction ({len(ran)} rows)"
    if failed:
        verdict += "; did not run: " + ", ".join(failed)
    here = f"\nMeasured here: {speeds_here.describe()}" if speeds_here is not None and speeds_here != result.speeds else ""
    return (
        format_table(rows, headers, title=f"Priced at {result.speeds.describe()}") + here + f"\nVerdict: {verdict}\n"
    )


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


def speeds_arg(value: str) -> Any:
    """``--gpu``: a name of lightmem's GPU table, or a JSON file of ``DeviceSpeeds.to_dict()``."""
    if value.endswith(".json"):
        return DeviceSpeeds.from_dict(json.loads(Path(value).read_text()))
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--gpu", default="h100", type=speeds_arg, help="a GPU name, or a JSON file of measured speeds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="PNG", help="also draw time per sample against batch size (needs matplotlib)")
    parser.add_argument("--save-plans", metavar="JSON", help="write the rows and each row's plan for --measure --plans")
    parser.add_argument("--measure", action="store_true", help="run each row's plan on this machine's GPU")
    parser.add_argument("--plans", metavar="JSON", help="with --measure: the rows and plans --save-plans wrote")
    parser.add_argument("--json-out", metavar="JSON", help="with --measure: also write predictions and measurements")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row with --measure (default 4)")
    parser.add_argument("--time-limit-s", type=float, default=float("inf"), help="with --measure: rows after this are not run")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.measure:
        if not torch.cuda.is_available():
            print("frontier: no CUDA device here: nothing to measure (run without --measure for the predictions)")
            return 0
        saved = json.loads(Path(args.plans).read_text()) if args.plans else {}
        deadline = time.monotonic() + args.time_limit_s
        report = {}
        for name in args.models:
            planned = Planned.from_dict(saved[name]) if name in saved else None
            planned, measured, here = measure(name, args.steps, deadline, planned)
            print(f"{name}: measured on {hardware()}" + (f", planned from {args.plans}" if name in saved else ""))
            print(measured_table(planned, measured, here))
            report[name] = {**planned.to_dict(), "measured": measured, "speeds_here": here.to_dict()}
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    found = {}
    for name in args.models:
        result = plan_frontier(name, args.gpu)
        found[name] = result
        if not args.json:
            print(f"{name}: predicted on {hardware()} (fake tensors), in {result.seconds:.0f} s")
            result.print()
            print()
    if args.json:
        print(json.dumps({name: result.to_dict() for name, result in found.items()}, indent=2))
    if args.save_plans:
        plans = {name: Planned.of(result).to_dict() for name, result in found.items()}
        Path(args.save_plans).write_text(json.dumps(plans, indent=2) + "\n")
    if args.plot:
        plot(found, args.plot, found[next(iter(found))].speeds.name if found else "")
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
    axes.set_title(f"The frontier, predicted for an {gpu} (fake tensors)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
