#!/bin/bash
# One lent GPU, about fifteen minutes in all: the quick selfcheck first (its report is committed
# under docs/gpu-runs/), then the per-op price comparison. `warm48` (second call) is the 48 GiB warm start.
# `frontier`: the quick selfcheck's GPU tests and plans_hold (plan="auto" on the GPT at 1x, 1.5x, 2x
# first; the other sections ran unchanged on the H100 before), then plan="auto" on GPT-2 at its
# frontier's batches (a step that waits on the host), then every
# frontier row's plan measured (planned on the CPU beforehand: benchmarks/gpu/frontier-plans-h100.json;
# GPT-2's held-out batch 5 first, then ResNet-50, then the GPT), then GPT-2's per-op profile with the
# host's time to issue a step if time is left, within `LIMIT` seconds in all (default 560).
# Run from the checkout: bash benchmarks/gpu/session.sh [all|warm48|frontier]. Writes under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lightmem-gpu}
mkdir -p "$OUT"
what=${1:-all}
if [ "$what" = all ] || [ "$what" = frontier ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
    echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1)"
    echo "cores: $(nproc)"; free -g | head -2; uname -r
    python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
  } > "$OUT/machine.txt" 2>&1
  cat "$OUT/machine.txt"
fi
if [ "$what" = frontier ]; then
  limit=${LIMIT:-560}
  timeout $((limit - 235)) python3 -m lightmem.selfcheck --quick --sections gpu_tests,plans_hold \
    --output "$OUT/quick.md" > "$OUT/quick.log" 2>&1
  echo "selfcheck exit $? after ${SECONDS} s"; grep -a -E "Verdict|^lightmem selfcheck|section" "$OUT/quick.log" | tail -n 20
  timeout 110 python3 benchmarks/plans_hold.py --measure --model gpt2 --time-limit-s 105 > "$OUT/plans_hold_gpt2.md" 2>&1
  echo "plans_hold gpt2 exit $? after ${SECONDS} s"; grep -v '^{' "$OUT/plans_hold_gpt2.md" | cut -c1-300 | tail -n 20
  left=$((limit - SECONDS - 10))
  timeout $left python3 benchmarks/frontier.py --measure --plans benchmarks/gpu/frontier-plans-h100.json \
    --models gpt2 resnet50 gpt --time-limit-s $((left - 40)) --json-out "$OUT/frontier.json" > "$OUT/frontier.txt" 2>&1
  echo "frontier exit $? after ${SECONDS} s"; grep -v '^{' "$OUT/frontier.txt" | cut -c1-250 | tail -n 60
  left=$((limit - SECONDS - 5))  # GPT-2's per-op profile and the host's time to issue its step
  [ $left -gt 30 ] && timeout $left python3 benchmarks/op_prices.py --measure --models gpt2 \
    --json-out "$OUT/op_prices_gpt2.json" > "$OUT/op_prices_gpt2.txt" 2>&1
  echo "op_prices exit $? after ${SECONDS} s"; tail -n 6 "$OUT/op_prices_gpt2.txt"
fi
if [ "$what" = all ]; then
  timeout 560 python3 -m lightmem.selfcheck --quick --output "$OUT/quick.md" > "$OUT/quick.log" 2>&1
  echo "selfcheck exit $?"; grep -a -E "Verdict|^lightmem selfcheck|section" "$OUT/quick.log" | tail -n 20
  timeout 120 python3 benchmarks/op_prices.py --measure --json-out "$OUT/op_prices.json" > "$OUT/op_prices.txt" 2>&1
  echo "op_prices exit $?"; tail -n 70 "$OUT/op_prices.txt"
fi
if [ "$what" = warm48 ]; then
  timeout 200 python3 benchmarks/warm_start.py --gib 48 --modes prepared-huge,prepared --micro-gib 8 --steps 5 > "$OUT/warm48.txt" 2>&1
  echo "warm_start exit $?"; cat "$OUT/warm48.txt" | tail -n 60
fi
