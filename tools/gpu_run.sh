#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call: CUDA tests, kernel benchmarks, backend check,
# offline throughput, serving A/B. Results land in $OUT (the device tool's output folder) or ./out; with
# PACK=1 they are packed into $OUT/all.tgz instead (the device tool returns only a few files, and no deep folders).
#   device run: PACK=1 bash tools/gpu_run.sh [stages...]    (carry .whl: the server stack's wheels)
# Stage `cuda_tests` is the whole test suite with the GPU present (every CUDA test on the device, the rest as on a
# CPU machine): the summary in $OUT/cuda_suite.txt, the full log with each failure in $OUT/cuda_suite_full.txt.
#   device run: bash tools/gpu_run.sh cuda_tests    (carry .whl)
# Stage `tests` runs only the GPU kernels' and the worker's tests, or TEST_PATHS.
# Stage `sleep` is sleep mode's CUDA tests and benchmark (docs/rl.md, docs/benchmarks.md).
# Stage `acceptance` is the GPU issue's three-arm A/B with two rounds (medians), `acceptance_rounds` the same with
# three rounds of no mask and mask and one of the pre-change arm; stage `diagnose` the next
# experiments on the mask arm's step (host or device, launch-ahead, deferred mask lists), `ahead_offline` the
# offline launch-ahead A/B, `offline_mask` offline throughput without / with masks, `offline_trees` the same
# for the trees in $TREES; stage `contention` the CPU-contention ones.
# Stage options: TEST_PATHS (tests), MASK_ARGS (e.g. --tilings), AB_ARGS, PROF_ARGS; CPU_SAMPLE=1 records
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
    --top-k 512 --logprobs 1 --logprobs-mode processed_logprobs "$@" 2>&1 | grep -e "^| [0-9]" -e "^step timing"
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
    cuda_tests) python3 -m pytest -p no:cacheprovider -rfE --durations=15 tests 2>&1 \
        | tee "$OUT/cuda_suite_full.txt" | tail -40 | tee "$OUT/cuda_suite.txt" ;;
    tests) python3 -m pytest -q -p no:cacheprovider ${TEST_PATHS:-tests/v1/attention tests/v1/sample tests/models tests/v1/worker} 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt" ;;
    async) python3 tools/gpu_async_check.py 2>&1 | grep -v Warning | tee "$OUT/async_check.txt" ;;
    graphs) python3 -m pytest -q -p no:cacheprovider tests/v1/worker/test_cudagraph.py 2>&1 | tail -3 | tee "$OUT/graph_tests.txt" ;;
    profile) python3 tools/gpu_profile_step.py --num-prompts 512 --output-len 96 2>&1 | grep -v Warning | tee "$OUT/profile.txt" ;;
    kprof) python3 tools/gpu_kernel_profile.py ${KPROF_ARGS:-} --out "$OUT" 2>&1 | grep -v -e Warning -e USDT | tee "$OUT/kernel_profile.txt" ;;
    hostprof) python3 tools/gpu_profile_step.py --cprofile --num-prompts 512 --output-len 64 2>&1 | grep -v Warning | tee "$OUT/host_profile.txt" ;;
    sampler) python3 benchmarks/kernels/benchmark_sampler.py --out "$OUT/sampler_bench.json" 2>&1 | tee "$OUT/sampler_bench.txt" ;;
    backend) python3 tools/gpu_backend_check.py 2>&1 | grep -v Warning | tee "$OUT/backend_check.txt" ;;
    mask) python3 benchmarks/kernels/benchmark_sampling_mask.py ${MASK_ARGS:-} --out "$OUT/mask_bench.json" 2>&1 | tee "$OUT/mask_bench.txt" ;;
    attn) python3 benchmarks/kernels/benchmark_attention.py --batch-sizes 64 256 512 --context 384 2>&1 | tee "$OUT/attn_bench.txt" ;;
    throughput_base)  # the same offline run on the code before the GPU issue (a snapshot in .snap_base)
      (cd .snap_base && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/benchmark_throughput.py \
        --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --skip-tokenizer-init --max-num-seqs 512 --num-prompts 64 256 512 \
        --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 --top-k 512 \
        --json-out "$OUT/throughput_base.json" 2>&1 | grep -v Warning | tee "$OUT/throughput_base.txt") ;;
    sleep)  # sleep mode (docs/rl.md): its CUDA tests (memory freed, same addresses, graphs replay), then the
      # benchmark at gpu_memory_utilization 0.9: memory held awake / asleep, sleep and wake times, throughput (~3 min)
      python3 -m pytest -q -p no:cacheprovider -rfE tests/v1/worker/test_sleep_cuda.py 2>&1 | tail -15 \
        | tee "$OUT/sleep_tests.txt"
      python3 benchmarks/benchmark_sleep.py --json-out "$OUT/sleep.json" 2>&1 | grep -v Warning | tee "$OUT/sleep.txt" ;;
    weight_update)  # in-place weight updates (docs/rl.md): disk from the page cache, IPC from a second process
      python3 benchmarks/benchmark_weight_update.py --json-out "$OUT/weight_update.json" 2>&1 | grep -v Warning \
        | tee "$OUT/weight_update.txt" ;;
    throughput) python3 benchmarks/benchmark_throughput.py --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --skip-tokenizer-init --max-num-seqs 512 --num-prompts 64 256 512 \
        --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 --top-k 512 \
        --json-out "$OUT/throughput.json" 2>&1 | grep -v Warning | tee "$OUT/throughput.txt" ;;
    mixed)  # branch wip/mixed-graphs in one call: its CUDA tests (TEST_PATHS adds more; full log kept), serving A/B
      # no mask / no mask with mixed forward graphs / with forward and sampler graphs / mask with both at 512 and
      # 1024 streams, then one offline run with both as a smoke test (~9 min)
      python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/v1/worker/test_mixed_cudagraph.py \
        tests/v1/worker/test_cudagraph.py ${TEST_PATHS:-} 2>&1 | tee "$OUT/mixed_tests_full.txt" | tail -15
      VLLM_ENGINE_STEP_TIMING=1 python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/mixed_ab" \
        --arms no-mask mask no-mask+VLLM_MIXED_CUDA_GRAPH=1 no-mask+VLLM_MIXED_CUDA_GRAPH=1+VLLM_SAMPLER_GRAPH_MIXED=1 \
        mask+VLLM_MIXED_CUDA_GRAPH=1+VLLM_SAMPLER_GRAPH_MIXED=1 --concurrencies 512 1024 \
        --mask-check count --num-prompts-per-concurrency 3 --level-timeout 20 --budget-s 300 2>&1 \
        | grep --line-buffered -v Warning | tee "$OUT/mixed_ab.txt"
      VLLM_MIXED_CUDA_GRAPH=1 VLLM_SAMPLER_GRAPH_MIXED=1 python3 benchmarks/benchmark_throughput.py \
        --model benchmarks/configs/qwen2.5-1.5b-instruct --load-format dummy --skip-tokenizer-init \
        --max-num-seqs 512 --num-prompts 512 --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 \
        --top-k 512 2>&1 | grep -v Warning | tail -1 | sed "s/^/mixed_graphs=1: /" | tee -a "$OUT/mixed_offline.txt" ;;
    throughput_mixed)  # the throughput stage with mixed prefill+decode steps as CUDA graphs (cudagraph.py)
      VLLM_MIXED_CUDA_GRAPH=1 python3 benchmarks/benchmark_throughput.py --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --skip-tokenizer-init --max-num-seqs 512 --num-prompts 64 256 512 \
        --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 --top-k 512 \
        --json-out "$OUT/throughput_mixed.json" 2>&1 | grep -v Warning | tee "$OUT/throughput_mixed.txt" ;;
    serveprof) python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/serveprof" --arms no-mask mask --concurrencies 512 \
        --cprofile-dir "$OUT/serveprof/prof" ${PROF_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/serveprof.txt"
      for f in "$OUT"/serveprof/prof/*/*.txt; do [ -f "$f" ] && cp "$f" "$OUT/prof_$(basename "$(dirname "$f")")_$(basename "$f")"; done
      rm -rf "$OUT"/serveprof/prof ;;
    topk) [ -f benchmarks/kernels/benchmark_topk_select.py ] && python3 benchmarks/kernels/benchmark_topk_select.py \
        --out "$OUT/topk_bench.json" 2>&1 | tee "$OUT/topk_bench.txt" ;;
    ab) VLLM_ENGINE_STEP_TIMING=${VLLM_ENGINE_STEP_TIMING:-1} python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/ab" ${AB_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/ab.txt" ;;
    diagnose)  # is the mask arm's 1024-stream step the host's or the device's (docs/benchmarks.md, "What is still
      # open"): the device step with the JSON kernels in the sampler graph; then no mask / mask / mask with
      # launch-ahead / that with the mask lists deferred past the launch, at 512 and 1024 streams, clients
      # counting masks from raw JSON, two rounds, with the step timing's device phases (dev.step, dev.gap) (~9 min)
      python3 tools/gpu_kernel_profile.py --rows 1024 --steps 20 --mask-text --out "$OUT" 2>&1 \
        | grep -v -e Warning -e USDT | tee "$OUT/kernel_profile_mask_text.txt"
      VLLM_ENGINE_STEP_TIMING=1 python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/diagnose" \
        --arms no-mask mask mask+VLLM_ENGINE_LAUNCH_AHEAD=1 \
        mask+VLLM_ENGINE_LAUNCH_AHEAD=1+VLLM_ENGINE_DEFER_MASK_LISTS=1 --rounds 2 --concurrencies 512 1024 \
        --mask-check count --num-prompts-per-concurrency 3 --level-timeout 20 --budget-s 440 2>&1 \
        | grep --line-buffered -v Warning | tee "$OUT/diagnose.txt" ;;
    ahead_offline)  # offline no-mask throughput at 512 requests without and with launch-ahead, ABBA (~3 min)
      for a in 0 1 1 0; do
        VLLM_ENGINE_LAUNCH_AHEAD=$a python3 benchmarks/benchmark_throughput.py \
          --model benchmarks/configs/qwen2.5-1.5b-instruct --load-format dummy --skip-tokenizer-init \
          --max-num-seqs 512 --num-prompts 512 --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 \
          --top-k 512 2>&1 | grep -v Warning | tail -1 | sed "s/^/launch_ahead=$a: /" | tee -a "$OUT/ahead_offline.txt"
      done ;;
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
      # (e.g. --async-engine: an AsyncLLM embedded in the benchmark's process instead of the LLM class)
      set -- ${TREES:?set TREES to the snapshot folders}
      order="$* $(printf '%s\n' "$@" | tac | tr '\n' ' ')"
      for t in $order; do for m in 0 1; do
        flags=""; [ "$m" = 1 ] && flags="--return-sampling-mask"
        (cd "$t" && PYTHONPATH=/tmp/site:$PWD VLLM_ENGINE_STEP_TIMING=1 offline_run --num-prompts 1024 $flags ${OFFLINE_FLAGS:-} \
          | sed "s|^|$(basename "$t") mask=$m |" | tee -a "$OUT/offline_trees.txt")
      done; done ;;
    contention)  # the mask arm against CPU contention: clients counting masks from raw JSON, plus server and
      # clients on disjoint CPUs, plus blocking-sync events (no spinning output thread), at 512/1024 (~7 min)
      pinned="--mask-check count --server-cpus 0-9 --client-cpus 10-15"
      for v in "count:0:--mask-check count" "pinned:0:$pinned" "blocking:1:$pinned"; do
        name=${v%%:*}; rest=${v#*:}; blocking=${rest%%:*}; args=${rest#*:}
        VLLM_OUTPUT_BLOCKING_SYNC=$blocking VLLM_ENGINE_STEP_TIMING=1 python3 benchmarks/ab_sampling_mask.py \
          --out-dir "$OUT/contention_$name" --arms no-mask mask --concurrencies 512 1024 \
          --num-prompts-per-concurrency 3 --level-timeout 20 --budget-s 120 $args 2>&1 \
          | grep --line-buffered -v Warning | tee "$OUT/contention_$name.txt"
      done ;;
    mixed_decide)  # whether to turn the mixed-step graphs on: no mask / mask, each without and with mixed forward
      # graphs + sampler graphs for steps with prefills, 256-1024 streams, two rounds (arm order reversed) (~8 min)
      both=VLLM_MIXED_CUDA_GRAPH=1+VLLM_SAMPLER_GRAPH_MIXED=1
      VLLM_ENGINE_STEP_TIMING=1 python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/mixed_decide" \
        --arms no-mask mask no-mask+$both mask+$both --rounds 2 --concurrencies 256 512 1024 \
        --mask-check count --num-prompts-per-concurrency 3 --level-timeout 20 --budget-s 500 2>&1 \
        | grep --line-buffered -v Warning | tee "$OUT/mixed_decide.txt" ;;
    flip_check)  # with the mixed-step graphs on by default: the graph tests (mixed + sampler graphs against eager
      # runners), then offline no-mask throughput at 512 requests with both switches off and on, ABBA (~4 min)
      timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/v1/worker/test_mixed_cudagraph.py \
        tests/v1/worker/test_cudagraph.py 2>&1 | tee "$OUT/flip_tests_full.txt" | tail -5
      for a in 0 1 1 0; do
        VLLM_MIXED_CUDA_GRAPH=$a VLLM_SAMPLER_GRAPH_MIXED=$a python3 benchmarks/benchmark_throughput.py \
          --model benchmarks/configs/qwen2.5-1.5b-instruct --load-format dummy --skip-tokenizer-init \
          --max-num-seqs 512 --num-prompts 512 --input-len 128 --output-len 256 --temperature 1.0 --top-p 0.95 \
          --top-k 512 2>&1 | grep -v Warning | tail -1 | sed "s/^/mixed_graphs=$a: /" | tee -a "$OUT/flip_offline.txt"
      done ;;
    acceptance)  # the GPU issue's A/B: three arms, 64-1024 streams, two rounds (CAB CBA), medians (~8 min).
      # Levels of 10 requests per stream, cut at 16 s (8 s for the pre-change arm, flat and CPU-bound): with 4 per
      # stream the 256-stream level was over in ~6 s, much of it the first wave's prefills (docs/benchmarks.md,
      # fifth session). LEVELS="..." overrides these three flags.
      # NOTE: the load generator shares the server's 16 CPUs (up to 8 client processes): it checks every mask
      # from its raw JSON (--mask-check count: validated, ids counted) rather than turning ~500 ids per token into
      # Python ints (parse, MASK_CHECK=parse): that parsing would run on the CPUs of the mask arm's server only.
      VLLM_ENGINE_STEP_TIMING=${VLLM_ENGINE_STEP_TIMING:-1} python3 benchmarks/ab_sampling_mask.py --out-dir "$OUT/acceptance" \
        --arms no-mask mask pre-change --rounds 2 --lead-arm pre-change --budget-s 500 \
        ${LEVELS:---num-prompts-per-concurrency 10 --level-timeout 16 --arm-level-timeout pre-change=8} \
        --mask-check ${MASK_CHECK:-count} \
        2>&1 | grep --line-buffered -v Warning | tee "$OUT/acceptance.txt" ;;
    acceptance_rounds)  # the same three arms, but no mask and mask in three rounds and the pre-change arm once,
      # at the very end (--arm-rounds: the last round; it once left the machine slower for the arm after it), 12 s
      # levels (~8.5 min): the rounds of one level differed by up to 12% on 2026-12-04 (host or device slower for a
      # whole level), so the two arms the ratio is about need more rounds than two; the pre-change arm's flat
      # throughput shows in one.
      VLLM_ENGINE_STEP_TIMING=${VLLM_ENGINE_STEP_TIMING:-1} python3 benchmarks/ab_sampling_mask.py \
        --out-dir "$OUT/acceptance_rounds" --arms no-mask mask pre-change --rounds 3 --arm-rounds pre-change=1 \
        --budget-s 520 \
        ${LEVELS:---num-prompts-per-concurrency 10 --level-timeout 12 --arm-level-timeout pre-change=6} \
        --mask-check ${MASK_CHECK:-count} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/acceptance_rounds.txt" ;;
  esac
done
[ -n "${sampler:-}" ] && kill "$sampler" "$gpu_sampler"
if [ "${PACK:-0}" = 1 ]; then
  # NOTE: the device tool returns only a few files: everything goes back as one archive.
  tar czf /tmp/gpu_run_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_run_all.tgz "$OUT/all.tgz"
fi
