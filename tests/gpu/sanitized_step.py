"""One offloaded step under TORCH_CUDA_SANITIZER=1 (run by test_races_cuda.py).

``python sanitized_step.py [WAITER AFTER]`` removes the waits of that kind first (a negative
control the sanitizer must report). Prints "bitwise equal" when the gradients match a step
without offload.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import race_kit as kit  # noqa: E402
import torch  # noqa: E402

from lightmem import offload_activations  # noqa: E402

device = torch.device("cuda", 0)
model, x = kit.make_model(device, depth=2), kit.make_input(device)[:1024]
expected = kit.baseline_step(model, x)
off = offload_activations(model)
if len(sys.argv) == 3:
    kit.drop_wait(off.transport, device, (sys.argv[1], sys.argv[2]))
model.zero_grad(set_to_none=True)
with off:
    loss = kit.loss_of(model, x)
loss.backward()
torch.cuda.synchronize()
print("bitwise equal" if not kit.differs(expected, kit.grads(model)) else "gradients differ")
