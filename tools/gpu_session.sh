#!/usr/bin/env bash
# One device call of this session's checks (kept small: the device budget is minutes): the CUDA tests of the
# merged features, the prefix-cache benchmarks (GRPO and multi-turn, cache on / off) and /health under attack.
#   device run: bash tools/gpu_session.sh   (carry .whl)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== cuda tests $(date +%T)"
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/v1/attention tests/v1/sample tests/models \
  tests/v1/worker tests/v1/e2e/test_prompt_logprobs.py 2>&1 | tail -12 | tee "$OUT/cuda_tests.txt"
M=benchmarks/configs/qwen2.5-1.5b-instruct
for c in "" --no-enable-prefix-caching; do
  echo "=== prefix grpo $c $(date +%T)"
  timeout 100 python3 benchmarks/benchmark_prefix_caching.py --model $M --load-format dummy --max-num-seqs 512 \
    --workload grpo --num-groups 64 --prompt-len 2048 --n 8 --output-len 256 $c 2>&1 | grep -v -e Warning -e INFO \
    | tail -6 | tee -a "$OUT/prefix.txt"
  echo "=== prefix multi-turn $c $(date +%T)"
  timeout 60 python3 benchmarks/benchmark_prefix_caching.py --model $M --load-format dummy --max-num-seqs 512 \
    --workload multi-turn --num-sessions 32 --turns 8 --turn-len 256 --output-len 128 $c 2>&1 \
    | grep -v -e Warning -e INFO | tail -6 | tee -a "$OUT/prefix.txt"
done
echo "=== health $(date +%T)"
timeout 90 python3 tools/health_under_attack.py --seconds 3 2>&1 | grep -v -e INFO -e WARNING | tee "$OUT/health.txt"
echo "=== done $(date +%T)"
