#!/usr/bin/env bash
# bench_engine.py on an accelerator (issue 14's GPU check), in one call: the
# qwen3-8b shape with random weights, kvwarm's BatchRunner against mlx-lm's bare
# BatchGenerator, then the host-bound shape (kvwarm's host work alone). Each run is
# its own process under a time limit, so one failure still leaves the others.
#   OUT=/some/dir bench/device_engine.sh        (MLX's CUDA backend on PYTHONPATH)
#   BITS="bf16 4" BATCHES="1 8 64 128" REPEATS=3 TOKENS=64 STEP_TIMEOUT=240  (defaults)
set -uo pipefail
out=${OUT:-/tmp}
log="$out/bench_engine.log"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" 2>&1 | tee "$log"
nvidia-smi -L 2>&1 | tee -a "$log"
for bits in ${BITS:-bf16 4}; do
  quantize=()
  [ "$bits" = bf16 ] || quantize=(--bits "$bits")
  timeout "${STEP_TIMEOUT:-240}" python3 bench/bench_engine.py --shape qwen3-8b --dtype bfloat16 \
    "${quantize[@]}" --batches ${BATCHES:-1 8 64 128} --repeats "${REPEATS:-3}" \
    --tokens "${TOKENS:-64}" 2>&1 | tee -a "$log"
done
timeout 60 python3 bench/bench_engine.py --shape host-bound --dtype bfloat16 \
  --batches ${BATCHES:-1 8 64 128} --repeats "${REPEATS:-3}" 2>&1 | tee -a "$log"
