"""Plans that hold: ``LightMem(plan="auto")`` at 1x, 1.5x, 2x, 5x and 8x the largest batch that fits
without lightmem, under a stated device cap.

The model is the one of issue 37's GPU run: a GPT of 16 pre-norm blocks (dim 1024, 16 heads, 1024
tokens, vocab 32000, SDPA attention), a Lightning fit in bf16-mixed with fused AdamW, under a 16 GiB
cap. On an H100 (torch 2.11) it fits batch 11 without lightmem; plan="auto" at batch 22 ran out of
memory, and at 55 and 88 trained with nothing on and ran out of memory. The frontier's multiples
(1x, 1.5x, 2x: issue 38 asks plan="auto"'s step to come within 15% of its prediction there) run
first, then 5x and 8x, which must be refused before their forward.

``--model gpt2``: Hugging Face's GPT-2 from its default config (124M parameters, 1024 tokens),
bf16-mixed, AdamW, under an 8 GiB cap, at the batches the frontier ran on the H100
(``GPT2_BATCHES``: 1x, 1.5x, 2x and the largest a plan fits). Its steps wait on the host, not the
device: what ``plan="auto"``'s block clock must hold against the step's timeline.

    python benchmarks/plans_hold.py                 # predictions: fake tensors, any machine (a few minutes)
    python benchmarks/plans_hold.py --measure       # on a GPU: the fits themselves, under the cap
    python benchmarks/plans_hold.py --measure --model gpt2 --batches 5   # GPT-2 at batch 5 alone
    python benchmarks/plans_hold.py --model gpt-chunked --gpu h200         # the GPT with lightmem.linear_cross_entropy

``--model gpt-chunked``: the GPT with its loss computed by ``lightmem.linear_cross_entropy``
(``CHUNKED_BATCHES``: 1x, 2.5x, 5x and 8x of 11, the largest batch the GPT trains without lightmem on
the H200): as written no plan fits past 2.5x, the loss's logits being most of the step.

Predicted, for each batch: whether plan="auto" accepts it (a plan fits) and the plan's predicted
peaks (allocated, and reserved with the allocator's share: what the plan must fit) and step time.
Measured (``--measure``): the largest batch without lightmem around the predicted one (two real
steps each), then a Lightning fit of a few steps at each multiple: accepted or refused before its
forward (``PlanDoesNotFit``), never out of memory; the measured peaks (``max_memory_allocated`` and
``max_memory_reserved``) and the first and steady step times beside the predictions. The device
memory is capped with ``torch.cuda.set_per_process_memory_fraction`` (the caching allocator only:
the CUDA context is outside the cap). ``selfcheck_section`` runs the measurement in a child process
with a time limit, for ``python -m lightmem.selfcheck``.
"""

from __future__ import annotations

import argparse
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

from _common import run_script  # noqa: E402
from lightmem import LightMem, PlanDoesNotFit, linear_cross_entropy, max_batch_size, plan  # noqa: E402
from lightmem.config import format_bytes, parse_size  # noqa: E402
from lightmem.estimate.frontier import labelled_batches  # noqa: E402
from lightmem.estimate.words import format_seconds  # noqa: E402

CAP = "16GiB"
GPT_CONFIG = {"vocab": 32000, "dim": 1024, "depth": 16, "heads": 16, "seq": 1024, "dropout": 0.0}
MULTIPLES = (2, 5, 8)
FRONTIER_MULTIPLES = (1, 1.5)
"""Measured first: with 2x, the frontier's rows where a plan costs least (the H100's third run, in
the other order, ran out of time before them)."""
MEASURED_MULTIPLES = (*FRONTIER_MULTIPLES, *MULTIPLES)
GPT2_CAP = "8GiB"
GPT2_BATCHES = {3: "1x", 5: "1.5x", 6: "2x", 7: "largest"}
"""GPT-2's frontier under 8 GiB on the H100 (``benchmarks/gpu/frontier-plans-h100.json``): batch 3
fits without lightmem; 5, 6 and 7 (the largest a plan fits) need a plan."""
CHUNKED_BATCHES = {11: "1x", 28: "2.5x", 55: "5x", 88: "8x"}
"""``--model gpt-chunked``: the GPT with ``lightmem.linear_cross_entropy``, at multiples of 11, the
largest batch the GPT trains without lightmem (and without a chunked loss) on an H200 under 16 GiB
(measured, 2026-11-28); as written, plan="auto" refused everything past 28 (2.5x) for the logits."""
STEPS = 7
"""Steps of each fit: the first (page-locking, allocator and cuDNN warm-ups), three whose blocks
plan="auto" times (it may plan again after them), then three of the last plan."""


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with fused=True, as the GPU runs trained (torch has a fused kernel on the CPU too, so the
    fake step traces the one kernel the GPU runs)."""
    return torch.optim.AdamW(params, lr=3e-4, fused=True)


def gpt_module(config: dict[str, Any] = GPT_CONFIG, chunked_loss: bool = False) -> Any:
    """The example GPT as a LightningModule with fused AdamW (what the GPU run trained); with
    ``chunked_loss``, its training step computes ``gpt_chunked_loss``."""
    from gpt_model import GPT

    class FusedGPT(GPT):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return fused_adamw(self.parameters())

        if chunked_loss:

            def _loss(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
                return gpt_chunked_loss(self, batch[0])

    return FusedGPT(**config)


def gpt_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def gpt_chunked_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``gpt_loss`` with ``lightmem.linear_cross_entropy``: the logits never whole."""
    return linear_cross_entropy(model.hidden_states(tokens[:, :-1]), model.lm_head.weight, tokens[:, 1:])


def gpt_chunked_module(config: dict[str, Any] = GPT_CONFIG) -> Any:
    """The GPT whose training step computes ``gpt_chunked_loss``."""
    return gpt_module(config, chunked_loss=True)


def gpt2_module() -> Any:
    """GPT-2 from transformers' default config as a LightningModule: next-token cross-entropy on
    1024-token batches, AdamW (lightmem's ``optimizer="adamw"``: torch's default AdamW)."""
    import pytorch_lightning as pl
    import transformers

    transformers.logging.set_verbosity_error()

    class LitGPT2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return gpt2_loss(self.model, batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    return LitGPT2()


def gpt2_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _gpt2_ids(batch: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 50257, (batch, 1024), device=device)


def _tokens(batch: int, config: dict[str, Any] = GPT_CONFIG, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, int(config["vocab"]), (batch, int(config["seq"]) + 1), device=device)


def _meta_model(config: dict[str, Any] = GPT_CONFIG) -> Any:
    with torch.device("meta"):
        return gpt_module(config)


def _meta_chunked(config: dict[str, Any] = GPT_CONFIG) -> Any:
    with torch.device("meta"):
        return gpt_chunked_module(config)


def _meta_gpt2() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config())


MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"cap": CAP, "module": gpt_module, "meta": _meta_model, "loss": gpt_loss, "batch": _tokens,
            "optimizer": fused_adamw},
    "gpt2": {"cap": GPT2_CAP, "module": gpt2_module, "meta": _meta_gpt2, "loss": gpt2_loss, "batch": _gpt2_ids,
             "optimizer": "adamw", "batches": GPT2_BATCHES},
    "gpt-chunked": {"cap": CAP, "module": gpt_chunked_module, "meta": _meta_chunked, "loss": gpt_chunked_loss,
                    "batch": _tokens, "optimizer": fused_adamw, "batches": CHUNKED_BATCHES},
}  # fmt: skip
"""Each model's cap, its LightningModule, its meta-device model and loss for the planner, a batch of
``n`` token ids (``batch(n, device)``), its optimizer, and, where the frontier fixed them, its
labelled batches (else multiples of its largest batch without lightmem)."""


def predictions(
    cap: str | None = None, multiples: tuple[int, ...] = MULTIPLES, gpu: str = "h100", model: str = "gpt"
) -> dict[str, Any]:
    """What the planner says, on fake tensors: the largest batch without lightmem and, at each
    multiple of it (or the model's own batches), plan="auto"'s choice (expandable segments on, as
    plan="auto" sets them), under ``cap`` (default: the model's)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    spec = MODELS[model]
    cap = cap or spec["cap"]
    meta, loss, batch_of = spec["meta"](), spec["loss"], spec["batch"]
    common = {"optimizer": spec["optimizer"], "precision": "bf16-mixed", "device": "cuda", "gpu": gpu}
    reference = max_batch_size(meta, batch_of(1), cap, loss, **common).baseline
    runs = spec.get("batches") or labelled_batches(reference, multiples)
    rows = []
    for batch, label in runs.items():
        found = plan(meta, batch_of(batch), cap, loss, checkpoint_policy="auto", **common)
        rows.append({
            "label": label, "batch": batch, "accepted": found.fits, "plan": "; ".join(found.parts()) or "nothing",
            "predicted_allocated": found.predicted_peak_bytes if found.fits else None,
            "predicted_reserved": found.predicted_total_bytes if found.fits else None,
            "predicted_step_s": found.step_seconds if found.fits else None,
            "dominant": found.dominant,
        })  # fmt: skip
    return {"cap": cap, "gpu": gpu, "model": model, "reference": reference, "rows": rows}


# -- on a GPU ---------------------------------------------------------------------------------------


def _fits_without_lightmem(batch: int, device: torch.device) -> bool:
    """Two real bf16 steps of the GPT at ``batch`` under the cap, without lightmem."""
    torch.manual_seed(0)
    model = gpt_module().to(device)
    optimizer = fused_adamw(model.parameters())
    try:
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = gpt_loss(model, _tokens(batch, device="cuda"))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()


def _fit_with_plan(
    batch: int, cap_bytes: int, steps: int, make_module: Any = gpt_module, make_batch: Any = _tokens
) -> dict[str, Any]:
    """A Lightning fit of ``steps`` steps at ``batch`` with LightMem(plan="auto", device_budget=cap)
    (``make_module()`` the LightningModule, ``make_batch(batch)`` one batch of token ids)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    forwards: list[int] = []
    times: list[float] = []
    priced: list[float] = []  # the plan's predicted step at each step (a re-plan changes it)
    plans: list[dict[str, Any]] = []  # each plan in effect, from the step it was first applied at
    reasons: list[str] = []  # why plan="auto" planned again, as it said

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.started)
            chosen = callback.chosen_plan
            priced.append(chosen.step_seconds if chosen is not None else 0.0)
            auto = callback.fit_session.auto_plan if callback.fit_session is not None else None
            if chosen is not None and (not plans or plans[-1]["plan"] != chosen.parts()):
                plans.append({"from_step": batch_idx, "plan": chosen.parts(), "predicted_s": chosen.step_seconds})
            if auto is not None and auto.replan_reason and auto.replan_reason not in reasons:
                reasons.append(auto.replan_reason)  # the next batch is planned again for this

    module = make_module()
    original = module.training_step

    def counted(batch_in: Any, batch_idx: int) -> Any:
        if not type(batch_in[0]).__name__ == "FakeTensor":
            forwards.append(batch_idx)
        return original(batch_in, batch_idx)

    module.training_step = counted
    loader = DataLoader([(make_batch(batch),) for _ in range(steps)], batch_size=None)
    callback = LightMem(plan="auto", device_budget=cap_bytes, log_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False, callbacks=[callback, Timer()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    outcome = "trained"
    try:
        trainer.fit(module, loader)
    except PlanDoesNotFit as error:
        outcome = "refused before its forward" if not forwards else "refused after a forward (wrong)"
        refusal = str(error)
    except torch.cuda.OutOfMemoryError:
        outcome = "OUT OF MEMORY"
    finally:
        stats = torch.cuda.memory_stats()
    chosen = callback.chosen_plan
    row: dict[str, Any] = {
        "batch": batch, "outcome": outcome, "forwards": len(forwards), "step_times_s": times,
        "predicted_steps_s": priced, "steady_s": final_plan_steady(times, priced),
        "measured_allocated": stats.get("allocated_bytes.all.peak", 0),
        "measured_reserved": stats.get("reserved_bytes.all.peak", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0), "plans": plans, "replan_reasons": reasons,
    }  # fmt: skip
    if outcome.startswith("refused"):
        row["refusal"] = refusal
    if chosen is not None and outcome == "trained":
        row.update({
            "plan": "; ".join(chosen.parts()) or "nothing", "predicted_allocated": chosen.predicted_peak_bytes,
            "predicted_reserved": chosen.predicted_reserved_bytes, "predicted_step_s": chosen.step_seconds,
            "speeds": chosen.speeds.describe() if chosen.speeds is not None else "",
        })  # fmt: skip
    del trainer, module, callback
    gc.collect()
    torch.cuda.empty_cache()
    return row


def final_plan_steady(times: list[float], priced: list[float]) -> float | None:
    """The median step of the last plan, its first step left out (step 0, or the first step after
    ``plan="auto"`` planned again, which pays its warm-ups) where later ones remain."""
    if len(times) < 2:
        return None
    first = len(priced) - 1
    while first > 0 and priced[first - 1] == priced[-1]:
        first -= 1
    steady = times[first + 1 :] or times[first:]
    return statistics.median(steady)


def replans(priced: list[float]) -> str:
    """The steps after which the plan's predicted step changed ("-": never), e.g. "after step 3":
    ``plan="auto"`` plans again when a block's measured forward is off its price."""
    after = [str(step - 1) for step in range(1, len(priced)) if priced[step] != priced[step - 1]]
    return f"after step {', '.join(after)}" if after else "-"


def replan_lines(row: dict[str, Any]) -> list[str]:
    """For a fit that planned again: each plan it ran, from which step, its predicted and measured
    steps (median of its steps after its first), and the reasons ``plan="auto"`` gave."""
    plans = row.get("plans") or []
    if len(plans) < 2:
        return []
    times, lines = row.get("step_times_s") or [], []
    for index, tried in enumerate(plans):
        end = plans[index + 1]["from_step"] if index + 1 < len(plans) else len(times)
        own = times[tried["from_step"] : end]
        steady = statistics.median(own[1:] or own) if own else None
        lines.append(
            f"- batch {row['batch']}, steps {tried['from_step']}-{end - 1}: {'; '.join(tried['plan']) or 'nothing'}, "
            f"predicted {format_seconds(tried['predicted_s'])}, measured {format_seconds(steady) if steady else '-'}"
        )
    lines += [f"- batch {row['batch']}: planned again because {reason}" for reason in row.get("replan_reasons") or []]
    return lines


def measure(
    cap: str | None = None, multiples: tuple[float, ...] = MEASURED_MULTIPLES, steps: int = STEPS,
    deadline: float = float("inf"), model: str = "gpt", batches: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The measurements (module docstring), while ``deadline`` (``time.monotonic``) lasts: ``model``
    at ``batches`` when given, else at its own batches (GPT-2: ``GPT2_BATCHES``, no reference
    trials), else at ``multiples`` of its measured largest batch; under ``cap`` (default: the model's)."""
    device = torch.device("cuda", torch.cuda.current_device())
    spec = MODELS[model]
    cap = cap or spec["cap"]
    cap_bytes = parse_size(cap, flag="cap")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    fits: dict[int, bool] = {}
    predicted_reference = measured_reference = None
    known = spec.get("batches") or {}
    if batches:
        runs = [(batch, known.get(batch, f"batch {batch}")) for batch in batches]
    elif known:
        runs = list(known.items())
    else:  # the GPT: its largest batch without lightmem, predicted and tried
        predicted_reference = max_batch_size(_meta_model(), _tokens(1), cap, gpt_loss, optimizer=fused_adamw,
                                             precision="bf16-mixed", device="cuda").baseline  # fmt: skip
        reference = predicted_reference
        fits[reference] = _fits_without_lightmem(reference, device)
        probe = reference + 1 if fits[reference] else reference - 1
        fits[probe] = _fits_without_lightmem(probe, device)
        measured_reference = max((b for b, ok in fits.items() if ok), default=None)
        runs = list(labelled_batches(reference, multiples).items())  # by size: the frontier's rows first
    rows = []
    for batch, label in runs:
        if time.monotonic() > deadline - 45:
            rows.append({"batch": batch, "label": label, "outcome": "not run (time limit)"})
            continue
        row = _fit_with_plan(batch, cap_bytes, steps, spec["module"], spec["batch"])
        row["label"] = label
        rows.append(row)
        print(json.dumps({"progress": row}, default=str), flush=True)
    return {
        "cap": cap, "device": torch.cuda.get_device_name(device), "model": model,
        "predicted_reference": predicted_reference,
        "reference_trials": {str(b): ok for b, ok in sorted(fits.items())}, "measured_reference": measured_reference,
        "rows": rows,
    }  # fmt: skip


def _model_text(result: dict[str, Any]) -> str:
    """The model, precision and optimizer of a result, and its largest batch without lightmem."""
    if result.get("model") == "gpt-chunked":
        return (f"GPT {GPT_CONFIG} with lightmem.linear_cross_entropy, Lightning bf16-mixed, fused AdamW, "
                f"`LightMem(plan='auto', device_budget=cap)`, {STEPS} steps per batch; batches are multiples of 11, "
                "the largest without lightmem and without a chunked loss on the H200 (2026-11-28).")  # fmt: skip
    if result.get("model") == "gpt2":
        return ("GPT-2 (transformers' default config, 1024 tokens), Lightning bf16-mixed, AdamW, "
                "`LightMem(plan='auto', device_budget=cap)`, "
                f"{STEPS} steps per batch; batch 3 is the largest without lightmem (the frontier's run).")  # fmt: skip
    trials = ", ".join(f"{b} ({'fits' if ok else 'OOM'})" for b, ok in result["reference_trials"].items())
    reference = (
        f" Largest batch without lightmem: predicted {result['predicted_reference']}; two real steps at {trials}."
        if result.get("predicted_reference") is not None else ""
    )
    return (f"GPT {GPT_CONFIG}, Lightning bf16-mixed, fused AdamW, `LightMem(plan='auto', device_budget=cap)`, "
            f"{STEPS} steps per batch.{reference}")  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """The measured table, with its verdict line."""
    lines = [
        "## Plans that hold",
        "",
        f"{result['device']}, cap {result['cap']} (`set_per_process_memory_fraction`), {_model_text(result)}",
        "",
        "| batch | outcome | plan | predicted peak allocated / reserved | measured peak allocated / reserved | "
        "alloc retries | first step | steady step (median, last plan) | predicted step (measured / predicted) | "
        "per sample vs the measured 1x | planned again |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    bad = []
    per_sample_1x = reference_per_sample(result["rows"])
    for row in result["rows"]:
        times = row.get("step_times_s") or []
        steady = row.get("steady_s")
        predicted = row.get("predicted_step_s")
        per_sample = f"{steady / row['batch'] / per_sample_1x:.2f}x" if steady and per_sample_1x else "-"
        lines.append(
            f"| {row['batch']} ({row.get('label') or str(row['multiple']) + 'x'}) | {row['outcome']} | {row.get('plan', '-')} | "
            + (f"{format_bytes(row['predicted_allocated'])} / {format_bytes(row['predicted_reserved'])}"
               if row.get("predicted_allocated") is not None else "-")
            + f" | {format_bytes(row.get('measured_allocated', 0))} / {format_bytes(row.get('measured_reserved', 0))} | "
            f"{row.get('alloc_retries', '-')} | {format_seconds(times[0]) if times else '-'} | "
            f"{format_seconds(steady) if steady else '-'} | {format_seconds(predicted) if predicted else '-'}"
            + (f" ({steady / predicted:.2f}x) |" if steady and predicted else " |")
            + f" {per_sample} | {replans(row.get('predicted_steps_s') or [])} |"
        )  # fmt: skip
        if row["outcome"] in ("OUT OF MEMORY", "refused after a forward (wrong)"):
            bad.append(f"batch {row['batch']}: {row['outcome']}")
    refusals = [f"- batch {row['batch']}: {row['refusal']}" for row in result["rows"] if row.get("refusal")]
    if refusals:
        lines += ["", "Refusals:", "", *refusals]
    replanned = [line for row in result["rows"] for line in replan_lines(row)]
    if replanned:
        lines += ["", "Planned again:", "", *replanned]
    verdict = "every accepted batch trained, every other refused before its forward" if not bad else "; ".join(bad)
    lines += ["", f"**Verdict:** {verdict}", "", steps_line(result["rows"]), ""]
    if per_sample_1x is None:
        lines[-1:-1] = ["Per sample: the 1x batch did not train here, so no row is told against a measured 1x.", ""]
    return "\n".join(lines)


STEP_MARGIN = 0.15
"""How far a steady step may be from its prediction for the plan's price to hold (issue 50)."""


def reference_per_sample(rows: list[dict[str, Any]]) -> float | None:
    """The measured steady step per sample of the row labelled "1x" (the largest batch without
    lightmem), which every row's per-sample cost is told against; None when it did not train."""
    reference = next((row for row in rows if row.get("label") == "1x" and row.get("steady_s")), None)
    return reference["steady_s"] / reference["batch"] if reference is not None else None


def steps_line(rows: list[dict[str, Any]]) -> str:
    """How many measured steady steps came within ``STEP_MARGIN`` of their prediction, naming those
    that did not."""
    timed = [row for row in rows if row.get("steady_s") and row.get("predicted_step_s")]
    if not timed:
        return "**Steps:** none measured against a prediction."
    off = [row for row in timed if abs(row["steady_s"] / row["predicted_step_s"] - 1) > STEP_MARGIN]
    within = len(timed) - len(off)
    text = f"**Steps:** {within} of {len(timed)} steady steps within {STEP_MARGIN:.0%} of their prediction"
    if off:
        text += " (off: " + ", ".join(f"batch {row['batch']} {row['steady_s'] / row['predicted_step_s']:.2f}x" for row in off) + ")"
    return text


def selfcheck_section(limit_s: float = 150.0) -> str:
    """Markdown for ``python -m lightmem.selfcheck``: the measurement in a child process, killed
    at ``limit_s`` (what it printed before is kept)."""
    if not torch.cuda.is_available():
        return "## Plans that hold\n\nNo CUDA device: nothing to measure.\n"
    output, error, _ = run_script(__file__, ["--measure", "--json", "--time-limit-s", str(limit_s - 10)], limit_s - 3)
    results = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    final = next((item for item in results if "rows" in item), None)
    if final is not None:
        return markdown(final)
    progress = [item["progress"] for item in results if "progress" in item]
    tail = "\n".join(error.strip().splitlines()[-30:])
    return (
        "## Plans that hold\n\n**Verdict:** did not finish\n\nRows measured before it stopped:\n\n```\n"
        + "\n".join(json.dumps(row, default=str) for row in progress)
        + f"\n```\n\n```\n{tail}\n```\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run the fits on this machine's GPU")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--time-limit-s", type=float, default=float("inf"))
    parser.add_argument("--model", choices=tuple(MODELS), default="gpt",
                        help="the GPT under 16 GiB (default), GPT-2 under 8 GiB, or the GPT with a chunked loss")
    parser.add_argument("--gpu", default="h100", help="predictions: the GPU whose speeds price them (default h100)")
    parser.add_argument("--batches", type=int, nargs="+", help="with --measure: these batches (default: the model's)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.time_limit_s
    if args.measure:
        if not torch.cuda.is_available():
            print("plans_hold: no CUDA device here: nothing to measure (run without --measure for the predictions)")
            return 0
        result = measure(deadline=deadline, model=args.model, batches=tuple(args.batches or ()) or None)
        print(json.dumps(result, default=str) if args.json else markdown(result))
        return 0
    result = predictions(model=args.model, gpu=args.gpu)
    what = {
        "gpt": f"GPT {GPT_CONFIG}, bf16-mixed, fused AdamW", "gpt2": "GPT-2, bf16-mixed, AdamW",
        "gpt-chunked": f"GPT {GPT_CONFIG} with lightmem.linear_cross_entropy, bf16-mixed, fused AdamW",
    }[args.model]  # fmt: skip
    print(f"Predicted on fake tensors ({result['gpu']}), cap {result['cap']}, {what}, "
          f"expandable segments: largest batch without lightmem {result['reference']}.")  # fmt: skip
    for row in result["rows"]:
        if row["accepted"]:
            print(f"  {row['label']} = batch {row['batch']}: accepted, {row['plan']}; predicted "
                  f"{format_bytes(row['predicted_allocated'])} allocated, {format_bytes(row['predicted_reserved'])} "
                  f"reserved with the overhead allowance, step {format_seconds(row['predicted_step_s'])}")  # fmt: skip
        else:
            print(f"  {row['label']} = batch {row['batch']}: refused before its forward ({row['dominant']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
