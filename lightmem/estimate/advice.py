"""Advice rules: what the estimate says the user should change, each rule one function.

Rules (identifiers as they appear in ``Advice.rule``):

- ``budget-below-overhead``: the budget is no larger than the overhead allowance it must hold: nothing
  is left for the step, whatever the model (said instead of ``static-exceeds-budget``).
- ``static-exceeds-budget``: parameters + gradients + optimizer state (+ overhead) exceed the
  budget by themselves, so no activation technique can help; name the options that can, first
  ``LightMem(offload_optimizer=True)`` when the parameters alone leave room (with that option on:
  the parameters alone exceed it, and without its ``device_dtype`` bf16 parameters come first).
- ``dense-zero-input``: a floating-point batch tensor is mostly zeros (read from the real values):
  one-hot features belong in an embedding, other sparse inputs in a sparse layout.
- ``quadratic-attention``: tensors saved for backward are attention scores, as the trace shows them
  (made from a product of two activations, query and key, that feeds a softmax, or from that
  softmax's output: ``op_chain.attention_scores``): use scaled_dot_product_attention.
- ``loss-logits``: the cross-entropy's logits, their float32 copies and gradients are a large
  share of the peak (large vocabularies): ``lightmem.linear_cross_entropy`` never holds them
  whole; the advice gives the predicted peak with it, the change in the user's own code (the
  statement that calls the cross-entropy, or ``LightMem(chunked_loss=True)`` for a Hugging Face
  model's own loss) and, with a budget, the largest batch without lightmem with it and without.
- ``reach-budget``: the step does not fit: the verified plan (which repeated layers to
  checkpoint or offload, and the peak it gives), or, when no plan fits, a smaller batch.
"""

from __future__ import annotations

from collections import defaultdict

from lightmem.config import format_bytes
from lightmem.estimate.chunked_loss import reach_sentence
from lightmem.estimate.planning.result import Plan
from lightmem.estimate.report import Advice, MemoryEstimate
from lightmem.estimate.trace.batch import BatchInfo
from lightmem.estimate.trace.logits import CHUNKED_LOSS
from lightmem.estimate.trace.step import StepTrace
from lightmem.estimate.words import compact_names, logits_share, natural_order

QUADRATIC_MIN_SHARE = 0.05
"""Quadratic saved tensors must be at least this share of saved activations to be worth a word."""
LOGITS_MIN_SAVING = 0.10
"""...and the chunked loss must take at least this share off the peak."""


def advise(
    estimate: MemoryEstimate, info: BatchInfo, baseline: StepTrace, plan: Plan | None = None
) -> list[Advice]:
    """Every rule that applies, in the order a user should act on them.

    ``plan`` is the verified plan for the estimate's budget (``lightmem.plan``'s search): the
    reach-budget advice reports it, so the advice and the plan tell one story.
    """
    found: list[Advice] = []
    found.extend(static_exceeds_budget(estimate))
    found.extend(dense_zero_input(estimate, info, baseline))
    found.extend(quadratic_attention(estimate, baseline))
    found.extend(loss_logits(estimate, baseline))
    found.extend(reach_budget(estimate, plan))
    return found


def static_exceeds_budget(estimate: MemoryEstimate) -> list[Advice]:
    if not estimate.static_exceeds_budget:
        return []
    assert estimate.budget_bytes is not None and estimate.available_bytes is not None
    if estimate.budget_below_overhead:  # nothing about the model can help
        shortfall = estimate.overhead_shortfall()
        return [Advice("budget-below-overhead", f"{shortfall[0].upper()}{shortfall[1:]}.")]
    parts = estimate.scenarios["baseline"].breakdown
    static = estimate.static_bytes
    if estimate.offload_optimizer:
        dtype = estimate.offload_optimizer_device_dtype
        halve = (
            ""
            if dtype is not None
            else "bf16 parameters on the device with fp32 masters on the host "
            "(LightMem(offload_optimizer_device_dtype='bf16') under precision='bf16-mixed'), which halves them; "
        )
        return [
            Advice(
                "static-exceeds-budget",
                f"{estimate.static_parts()} alone take {format_bytes(static)} (gradients and "
                f"optimizer state are on the host with offload_optimizer), over the "
                f"{format_bytes(estimate.available_bytes)} the {format_bytes(estimate.budget_bytes)} budget leaves "
                f"after the {format_bytes(estimate.overhead_bytes)} overhead allowance. Options: {halve}bf16 weights "
                "(precision='bf16-true'); sharding across GPUs (FSDP with CPU offload, DeepSpeed ZeRO-3 "
                "offload); or a smaller model.",
            )
        ]
    if estimate.overhead_bytes:
        over = (
            f"alone take {format_bytes(static)}; with the {format_bytes(estimate.overhead_bytes)} overhead "
            f"allowance that is {format_bytes(static + estimate.overhead_bytes)}, which leaves no room for "
            f"activations in the {format_bytes(estimate.budget_bytes)} budget"
        )
    else:
        over = (
            f"alone take {format_bytes(static)}, which leaves no room for activations in the "
            f"{format_bytes(estimate.budget_bytes)} budget"
        )
    return [
        Advice(
            "static-exceeds-budget",
            f"{estimate.static_parts()} {over}: no activation technique "
            "(offload, checkpointing, a smaller batch) can help. "
            + (
                f"Options: LightMem(offload_optimizer=True) (lightmem.offload_optimizer in plain PyTorch) keeps "
                f"only the parameters ({format_bytes(parts['parameters'])}) on the device and moves gradients, "
                "optimizer state and the optimizer step to host memory; "
                if estimate.parameters_fit
                else "Options: "
            )
            + "bf16 weights (precision='bf16-true' halves parameters, gradients and state); an 8-bit "
            "optimizer (bitsandbytes AdamW8bit) or a stateless one (SGD without momentum; Adafactor keeps "
            "factored state); sharding across GPUs (FSDP, DeepSpeed ZeRO); optimizer state offload to CPU "
            "(DeepSpeed ZeRO-Offload); or a smaller model.",
        )
    ]


def dense_zero_input(estimate: MemoryEstimate, info: BatchInfo, baseline: StepTrace) -> list[Advice]:
    found = []
    for item in info.sparse_inputs:
        if item.one_hot:
            fix = (
                "it is one-hot: pass the indices (argmax over the last dim) to an nn.Embedding, which "
                "computes the same as one-hot @ weight without the dense tensor"
            )
        else:
            fix = "store it as indices for an nn.Embedding / nn.EmbeddingBag, or as a sparse tensor"
        found.append(
            Advice(
                "dense-zero-input",
                f"{item.path} is a dense {item.dtype} tensor of shape {list(item.shape)} "
                f"({format_bytes(item.nbytes)}) that is {100 * item.zero_fraction:.1f}% zeros; {fix}.",
            )
        )
    return found


def quadratic_attention(estimate: MemoryEstimate, baseline: StepTrace) -> list[Advice]:
    total = sum(saved.nbytes for saved in baseline.saved_at_forward_end) or 1
    quadratic = 0
    count = 0
    by_block: dict[str, int] = defaultdict(int)
    shape = None
    for saved in baseline.saved_at_forward_end:
        if saved.attention_scores:
            quadratic += saved.nbytes
            count += 1
            by_block[saved.block] += saved.nbytes
            shape = saved.shape
    if quadratic < QUADRATIC_MIN_SHARE * total:
        return []
    blocks = compact_names(sorted(by_block, key=natural_order), estimate.block_kinds)
    return [
        Advice(
            "quadratic-attention",
            f"{count} saved tensors of shape like {list(shape or ())} take {format_bytes(quadratic)} "
            f"({100 * quadratic / total:.0f}% of saved activations, in {blocks}): attention scores kept for "
            "backward grow with the square of the sequence length. "
            "torch.nn.functional.scaled_dot_product_attention computes attention without keeping them "
            "(memory linear in sequence length).",
        )
    ]


def loss_logits(estimate: MemoryEstimate, baseline: StepTrace) -> list[Advice]:
    logits = baseline.loss_logits
    peak = baseline.peak
    if logits is None or not logits.dominates(peak.bytes):
        return []
    saving = peak.bytes - logits.peak_bytes_chunked
    if saving < LOGITS_MIN_SAVING * peak.bytes:
        return []
    share = (
        f"{logits_share(logits)} of the {format_bytes(peak.bytes)} peak ({100 * logits.bytes_at_peak / peak.bytes:.0f}%, "
        f"at {peak.phase}: {peak.op}); checkpointing and offload cannot reach them."
    )
    if not logits.replaceable:
        return [Advice("loss-logits", f"{share} {logits.change[0].upper()}{logits.change[1:]}.")]
    return [
        Advice(
            "loss-logits",
            f"{share} {CHUNKED_LOSS} computes the loss from the "
            f"hidden states in chunks and never holds them whole: predicted peak about "
            f"{format_bytes(logits.peak_bytes_chunked)} ({format_bytes(saving)} less), counting the "
            f"{format_bytes(logits.chunked_kept_bytes)} of gradients and one chunk of logits it keeps instead. "
            f"The change: {logits.change}." + reach_sentence(estimate.chunked_loss),
        )
    ]


def reach_budget(estimate: MemoryEstimate, plan: Plan | None) -> list[Advice]:
    if plan is None or estimate.budget_bytes is None:
        return []
    if estimate.baseline_fits or estimate.static_exceeds_budget:
        return []
    if estimate.offload_optimizer and estimate.fits:  # the configuration asked for fits
        return []
    need = estimate.scenarios["baseline"].reserved - (estimate.available_bytes or 0)  # as baseline_fits counts
    budget = format_bytes(estimate.budget_bytes)
    if not plan.fits:
        return [
            Advice(
                "reach-budget",
                f"the step needs {format_bytes(need)} less to fit {budget}, and no lightmem configuration "
                f"gets it there ({plan.reason}); reduce the batch size (lightmem.max_batch_size finds the "
                "largest that fits) or the model.",
            )
        ]
    parts = plan.parts()  # the plan words its own configuration (offload everywhere included)
    return [
        Advice(
            "reach-budget",
            f"to fit {budget} the step needs {format_bytes(need)} less: "
            + " and ".join(parts)
            + f" brings the peak to {format_bytes(plan.predicted_total_bytes)} with the overhead allowance "
            f"(verified by the estimator; lightmem.plan(...).lightmem_kwargs() gives the LightMem flags).",
        )
    ]
