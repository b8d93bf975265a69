#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call: the stages that reproduce docs/benchmarks.md, the
# CUDA tests and the weight-update benchmark. Results land in $OUT (the device tool's output folder) or ./out; with
# PACK=1 they are packed into $OUT/all.tgz instead (the device tool returns only a few files, and no deep folders).
#   device run: PACK=1 bash tools/gpu_run.sh [stages...]    (carry .whl: the server stack's wheels)
# Stage `cuda_tests` is the whole test suite (or SHARD=i/n of its files) with the GPU present (every CUDA test on the device, the rest as on a
# CPU machine): the summary in $OUT/cuda_suite.txt, the full log with each failure in $OUT/cuda_suite_full.txt.
#   device run: bash tools/gpu_run.sh cuda_tests    (carry .whl)
# Stage `tests` runs only the GPU kernels' and the worker's tests, or TEST_PATHS.
# Stages of docs/benchmarks.md: `backend` (Triton attention vs the torch reference), `mask`, `attn`, `topk`,
# `sampler` (kernel benchmarks), `kprof` (the decode step kernel by kernel), `throughput` (offline, no mask),
# `offline_mask` (offline without / with masks), `ab` (the serving A/B, AB_ARGS; its `--paths` adds the non-streamed
# completions / chat / generate and the offline LLM.generate arms of issue 30), `acceptance_rounds` (the serving
# A/B of the headline: no mask and mask, three rounds), `weight_update` (RL weight updates), `sleep` (sleep mode's
# CUDA tests and benchmark), `prefix` (the prefix cache's GRPO and multi-turn benchmarks, cache on and off). `offline_trees` compares source trees offline (TREES; tools/snap_trees.sh),
# tools/gpu_ab_trees.sh the same for the serving A/B.
# Stage options: TEST_PATHS (tests), MASK_ARGS (e.g. --tilings), KPROF_ARGS, AB_ARGS; CPU_SAMPLE=1 records
# per-thread CPU use (tools/cpu_sample.py) and the GPU's clocks and throttle reasons while the stages run.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/msgspec ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
stages=${*:-"info tests backend mask attn throughput"}
# The offline stages' run (offline_mask, offline_trees): the A/B's model and sampling settings with logprobs=1 and
# processed logprobs, the table's rows only; extra flags (requests, --return-sampling-mask) after them.
offline_run() {
  python3 benchmarks/benchmark_throughput.py --model benchmarks/configs/qwen2.5-1.5b-instruct --load-format dummy \
    --skip-tokenizer-init --max-num-seqs 1024 --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 \
    --top-k 512 --logprobs 1 --logprobs-mode processed_logprobs "$@" 2>&1 | grep -e "^| [0-9]"
}
if [ "${CPU_SAMPLE:-0}" = 1 ]; then  # per-thread CPU use of the python processes, every 5 s, during all stages
  python3 tools/cpu_sample.py > "$OUT/cpu_sample.txt" 2>&1 & sampler=$!
  # NOTE: and the GPU's clocks, power, temperature and throttle reasons every 2 s (read only): a level whose
  # device step runs slower shows why here (2026-12-04: one level's device step 10% slower than the others').
  bash tools/gpu_sample.sh 2 > "$OUT/gpu_sample.csv" 2>&1 & gpu_sampler=$!
fi
for s in $stages; do
  echo "=== $s $(date +%T)"
  case $s in
    info) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; echo "SMT siblings: $(sort -u /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | tr "\n" " ")"; lscpu | grep -i -e "model name" -e "thread(s) per core" -e "core(s) per socket" -e "^CPU(s)" -e MHz; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
      # NOTE: the host's single-thread Python speed: the A/B's mask arm depends on it (docs/benchmarks.md, eighth
      # session: hosts ~25% apart); best of five runs of a fixed loop.
      python3 -c "import timeit; print('python loop ms (best of 5):', round(1e3 * min(timeit.repeat('sum(i * i for i in range(1000000))', number=1, repeat=5)), 1))" ;;
    cuda_tests)  # SHARD=i/n: the i-th of n parts (test files in turn, tests/conftest.py's TEST_SHARD), for a suite
      # longer than one device call (on the H100, 2026-12-06: ~340 s and ~495 s for two of three parts; use
      # SHARD=i/4). -vv names each test (pyproject's -q cancels one -v). A test still running after 240 s dumps every
      # thread's stack into the log (pytest's faulthandler_timeout) and, where pytest-timeout is installed (the
      # device's python has it), ends at 300 s: one hung test no longer eats the call (2026-12-06: it did).
      to=""; python3 -c "import pytest_timeout" 2>/dev/null && to="--timeout=300"
      TEST_SHARD=${SHARD:-} python3 -m pytest -p no:cacheprovider -vv -rfE --durations=15 -o faulthandler_timeout=240 \
        $to tests 2>&1 \
        | tee "$OUT/cuda_suite_full.txt" | grep -v -e PASSED -e SKIPPED | tail -40 | tee "$OUT/cuda_suite.txt" ;;
    tests) python3 -m pytest -q -p no:cacheprovider ${TEST_PATHS:-tests/v1/attention tests/v1/sample tests/models tests/v1/worker} 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt" ;;
    kprof) python3 tools/profiling/gpu_kernel_profile.py ${KPROF_ARGS:-} --out "$OUT" 2>&1 | grep -v -e Warning -e USDT | tee "$OUT/kernel_profile.txt" ;;
    sampler) python3 benchmarks/kernels/benchmark_sampler.py --out "$OUT/sampler_bench.json" 2>&1 | tee "$OUT/sampler_bench.txt" ;;
    backend) python3 tools/gpu_backend_check.py 2>&1 | grep -v Warning | tee "$OUT/backend_check.txt" ;;
    mask) python3 benchmarks/kernels/benchmark_sampling_mask.py ${MASK_ARGS:-} --out "$OUT/mask_bench.json" 2>&1 | tee "$OUT/mask_bench.txt" ;;
    attn) python3 benchmarks/kernels/benchmark_attention.py --batch-sizes 64 256 512 --context 384 2>&1 | tee "$OUT/attn_bench.txt" ;;
    sleep)  # sleep mode (docs/rl.md): its CUDA tests (memory freed, same addresses, graphs replay), then the
      # benchmark at gpu_memory_utilization 0.9: memory held awake / asleep, sleep and wake times, throughput (~3 min)
      python3 -m pytest -q -p no:cacheprovider -rfE tests/v1/worker/test_sleep_cuda.py 2>&1 | tail -15 \
        | tee "$OUT/sleep_tests.txt"
      python3 benchmarks/benchmark_sleep.py --json-out "$OUT/sleep.json" 2>&1 | grep -v Warning | tee "$OUT/sleep.txt" ;;
    prefix)  # the prefix cache (docs/benchmarks.md): GRPO (64 prompts x 2048 tokens, n = 8, 256 out) and multi-turn
      # (32 sessions x 8 turns of +256 tokens, 128 out), offline, cache on then off (~2 min)
      m="--model benchmarks/configs/qwen2.5-1.5b-instruct --load-format dummy --skip-tokenizer-init --max-num-seqs 512"
      for c in "" --no-enable-prefix-caching; do
        python3 benchmarks/benchmark_prefix_caching.py $m --workload grpo --num-groups 64 --prompt-len 2048 --n 8 \
          --output-len 256 $c 2>&1 | grep "^|" | tail -1 | tee -a "$OUT/prefix.txt"
        python3 benchmarks/benchmark_prefix_caching.py $m --workload multi-turn --num-sessions 32 --turns 8 \
          --turn-len 256 --output-len 128 $c 2>&1 | grep "^|" | tail -1 | tee -a "$OUT/prefix.txt"
      done ;;
    weight_update)  # in-place weight updates (docs/rl.md): disk from the page cache, IPC from a second process
      python3 benchmarks/benchmark_weight_update.py --json-out "$OUT/weight_update.json" 2>&1 | grep -v Warning \
        | tee "$OUT/weight_update.txt" ;;
    throughput) python3 benchmarks/benchmark_throughput.py --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --skip-tokenizer-init --max-num-seqs 512 --num-prompts 64 256 512 \
        --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 --top-k 512 \
        --json-out "$OUT/throughput.json" 2>&1 | grep -v Warning | tee "$OUT/throughput.txt" ;;
    topk) python3 benchmarks/kernels/benchmark_topk_select.py ${TOPK_ARGS:---dtype bfloat16} --out "$OUT/topk_bench.json" \
        2>&1 | tee "$OUT/topk_bench.txt" ;;
    ab) python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/ab" ${AB_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/ab.txt" ;;
    offline_mask)  # offline LLM.generate of 512 and 1024 requests without / with masks (logprobs=1, processed
      # logprobs, as the A/B), the engine core in process (order A B B A) then in its own process
      # (VLLM_ENABLE_V1_MULTIPROCESSING=1, A B); every mask counted after each level (~5 min)
      for run in 0:0 0:1 0:1 0:0 1:0 1:1; do
        mp=${run%%:*}; m=${run#*:}; flags=""; [ "$m" = 1 ] && flags="--return-sampling-mask"
        VLLM_ENABLE_V1_MULTIPROCESSING=$mp offline_run --num-prompts 512 1024 $flags \
          | sed "s/^/multiprocessing=$mp mask=$m /" | tee -a "$OUT/offline_mask.txt"
      done ;;
    offline_trees)  # offline throughput of each tree in $TREES (snapshots, e.g. .snap/1-main .snap/2-wip_x from
      # tools/snap_trees.sh; carry .snap), no mask then mask at 1024 requests, tree order A B .. then .. B A (~6 min
      # for two trees); each tree's own benchmark script and vllm; OFFLINE_FLAGS more benchmark_throughput flags
      # (e.g. --async-engine: an AsyncLLM embedded in the benchmark's process instead of the LLM class);
      # OFFLINE_MASKS="0" runs the no-mask rows only (half the time)
      set -- ${TREES:?set TREES to the snapshot folders}
      order="$* $(printf '%s\n' "$@" | tac | tr '\n' ' ')"
      for t in $order; do for m in ${OFFLINE_MASKS:-0 1}; do
        flags=""; [ "$m" = 1 ] && flags="--return-sampling-mask"
        (cd "$t" && PYTHONPATH=/tmp/site:$PWD offline_run --num-prompts 1024 $flags ${OFFLINE_FLAGS:-} \
          | sed "s|^|$(basename "$t") mask=$m |" | tee -a "$OUT/offline_trees.txt")
      done; done ;;
    acceptance_rounds)  # the headline serving A/B: no mask and mask, 64-1024 streams, three rounds (arm order
      # alternating), 12 s levels of 10 requests per stream (~7 min). The rounds of one level differed by up to 12%
      # on 2026-12-04 (host or device slower for a whole level): medians of three, each round's ratios listed.
      # NOTE: the load generator shares the server's 16 CPUs: it checks every mask from its raw JSON
      # (--mask-check count) rather than turning ~500 ids per token into Python ints (MASK_CHECK=parse).
      python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/acceptance_rounds" --arms no-mask mask --rounds 3 \
        --budget-s 460 ${LEVELS:---num-prompts-per-concurrency 10 --level-timeout 12} \
        --mask-check ${MASK_CHECK:-count} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/acceptance_rounds.txt" ;;
  esac
done
[ -n "${sampler:-}" ] && kill "$sampler" "$gpu_sampler"
if [ "${PACK:-0}" = 1 ]; then
  # NOTE: the device tool returns only a few files: everything goes back as one archive.
  tar czf /tmp/gpu_run_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_run_all.tgz "$OUT/all.tgz"
fi
