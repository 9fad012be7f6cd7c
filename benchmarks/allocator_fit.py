"""The largest batches the planner gives under the caps the GPUs ran under, beside what they measured.

Each step's requests are replayed through the caching allocator (``lightmem.estimate.device.caching_allocator``),
with and without expandable segments, priced at the H100's speeds, ``overhead_bytes=0`` (the GPU runs
capped the caching allocator with ``set_per_process_memory_fraction``: the CUDA context was outside).

    python benchmarks/allocator_fit.py            # fake tensors, any machine (a few minutes)

Measured (``../shared/gpu-runs/2026-11-27``, ``2026-11-28``): the GPT of ``plans_hold.py`` trained at 11
under 16 GiB and not 12 (H100, H200); ResNet-50 at 143 under 12 GiB (H100); with every saved tensor of
at least 1 MiB offloaded, ResNet-50 trained at 600 under 12 GiB (H100) and 597 (H200).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))
sys.path.insert(0, str(CHECKOUT / "tests"))

from layout_models import classification_loss, image_batch, user_resnet50  # noqa: E402
from plans_hold import _meta_model, _tokens, fused_adamw, gpt_loss  # noqa: E402

from lightmem import max_batch_size, plan  # noqa: E402
from lightmem.tables import format_table  # noqa: E402

COMMON = {"device": "cuda", "gpu": "h100", "overhead_bytes": 0}


def rows() -> list[list[str]]:
    gpt = {"optimizer": fused_adamw, "precision": "bf16-mixed", **COMMON}
    resnet = {"optimizer": "sgd", **COMMON}
    found = []
    started = time.perf_counter()
    found.append(["GPT, 16 GiB, largest batch without lightmem", "11 (H100, H200)",
                  str(max_batch_size(_meta_model(), _tokens(8), "16GiB", gpt_loss, **gpt).baseline)])
    found.append(["ResNet-50, 12 GiB, largest batch without lightmem", "143 (H100)",
                  str(max_batch_size(user_resnet50(), image_batch(128), "12GiB", classification_loss, **resnet).baseline)])
    chosen = plan(user_resnet50(), image_batch(570), "12GiB", classification_loss, **resnet)
    found.append(["ResNet-50 at 570, 12 GiB: plan", "600 trained offloading (H100)",
                  f"{'fits' if chosen.fits else 'refused'}: {'; '.join(chosen.parts()) or chosen.reason}"])
    search = max_batch_size(user_resnet50(), image_batch(570), "12GiB", classification_loss, plan=True, **resnet)
    found.append(["ResNet-50, 12 GiB, max_batch_size(plan=True)", "600 (H100), 597 (H200)", str(search.planned)])
    found.append(["(seconds)", "", f"{time.perf_counter() - started:.0f}"])
    return found


def main() -> None:
    for expandable in (False, True):
        if expandable:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        else:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        title = f"Expandable segments {'on' if expandable else 'off'}, priced at the H100's speeds, overhead_bytes=0"
        print(format_table(rows(), ["question", "measured on a GPU", "predicted here"], title=title))
        print()


if __name__ == "__main__":
    main()
