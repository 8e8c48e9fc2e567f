#!/usr/bin/env bash
# bench_engine.py on an accelerator (issue 14's GPU check), in one call: the
# qwen3-8b shape with random weights, bf16 then 4-bit, kvwarm's BatchRunner
# against mlx-lm's bare BatchGenerator at batch 1, 8, 64 and 128. Each run is its
# own process under a time limit, so a failure in one still leaves the others.
#   OUT=/some/dir bench/device_engine.sh     (MLX's CUDA backend on PYTHONPATH)
set -uo pipefail
out=${OUT:-/tmp}
log="$out/bench_engine.log"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" 2>&1 | tee "$log"
nvidia-smi -L 2>&1 | tee -a "$log"
for bits in "" 4; do
  timeout "${STEP_TIMEOUT:-240}" python3 bench/bench_engine.py --shape qwen3-8b --dtype bfloat16 \
    ${bits:+--bits $bits} --batches 1 8 64 128 --repeats "${REPEATS:-3}" 2>&1 | tee -a "$log"
done
