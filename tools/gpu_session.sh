#!/usr/bin/env bash
# One device call of this session's checks (the device budget is minutes): the CUDA tests of the merged features,
# the prefix-cache benchmarks (GRPO and multi-turn, cache on / off) and the penalties' serving A/B (mask against
# mask with presence_penalty=0.5, repetition_penalty=1.1).
#   device run: bash tools/gpu_session.sh   (carry .whl)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== cuda tests $(date +%T)"
timeout 230 python3 -m pytest -q -p no:cacheprovider -rfE tests/v1/attention tests/v1/sample tests/models \
  tests/v1/worker tests/v1/e2e/test_prompt_logprobs.py 2>&1 | tail -8 | tee "$OUT/cuda_tests.txt"
M="--model benchmarks/configs/qwen2.5-1.5b-instruct --load-format dummy --skip-tokenizer-init --max-num-seqs 512"
for c in "" --no-enable-prefix-caching; do
  echo "=== prefix $c $(date +%T)"
  timeout 80 python3 benchmarks/benchmark_prefix_caching.py $M --workload grpo --num-groups 64 --prompt-len 2048 \
    --n 8 --output-len 256 $c 2>&1 | grep "^|" | tail -1 | tee -a "$OUT/prefix.txt"
  timeout 50 python3 benchmarks/benchmark_prefix_caching.py $M --workload multi-turn --num-sessions 32 --turns 8 \
    --turn-len 256 --output-len 128 $c 2>&1 | grep "^|" | tail -1 | tee -a "$OUT/prefix.txt"
done
echo "=== penalties A/B $(date +%T)"
timeout 200 python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/ab_pen" --arms mask \
  mask@presence_penalty=0.5@repetition_penalty=1.1 --concurrencies 512 1024 --num-prompts-per-concurrency 4 \
  --level-timeout 12 --budget-s 170 --mask-check count 2>&1 | grep -v Warning | tail -14 | tee "$OUT/ab_pen.txt"
grep -h -i -e "sampler cuda graphs" -e "eagerly" "$OUT"/ab_pen/server_*.log 2>/dev/null | cut -c1-200 | sort | uniq -c | head
echo "=== done $(date +%T)"
