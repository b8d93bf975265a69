#!/usr/bin/env bash
# The serving A/B of two source trees side by side in one device call (a code change against the code before it):
# runs `tools/gpu_run.sh ab` in TREE_A, TREE_B, TREE_B, TREE_A (ABBA: drift of the machine falls on both sides),
# with a per-thread CPU sample (tools/cpu_sample.py) over all four, and packs everything into $OUT/all.tgz.
#   device run: bash tools/gpu_ab_trees.sh .snap/old .snap/new     (carry .snap; .whl inside one of the trees)
# AB_ARGS as for gpu_run.sh (default: no-mask and mask at 512 and 1024 streams, 3 prompts per stream); runs 2-4 get
# --no-prime (the first run's priming start fills the machine's kernel caches for all four; that run gets
# PRIME_EXTRA_S more --budget-s for it). TEST_PATHS: if set, the new tree's CUDA tests run first (a branch's first
# call and its A/B in one; log in r/tests_new.txt).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd)
OUT=${OUT:-out}; mkdir -p "$OUT/r"; OUT=$(cd "$OUT" && pwd); R=$OUT/r
HERE=$(cd "$(dirname "$0")" && pwd)
for t in "$A" "$B"; do
  if [ ! -d /tmp/site/msgspec ] && ls "$t"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$t"/.whl/*.whl
  fi
done
if [ -n "${TEST_PATHS:-}" ]; then
  echo "=== tests (new) $(date +%T)"
  (cd "$B" && PYTHONPATH=/tmp/site:$B PYTHONUNBUFFERED=1 timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q \
    -p no:cacheprovider --tb=short -rfE $TEST_PATHS > "$R/tests_new.txt" 2>&1; echo "pytest rc=$?" >> "$R/tests_new.txt"
    tail -5 "$R/tests_new.txt")  # NOTE: pyproject's addopts has -q: with this one no summary line, hence the rc
fi
python3 "$HERE/cpu_sample.py" --interval 2 --top 24 > "$R/cpu_sample.txt" 2>&1 & CS=$!
bash "$HERE/gpu_sample.sh" 2 > "$R/gpu_sample.csv" 2>&1 & GS=$!
AB_ARGS=${AB_ARGS:-"--arms no-mask mask --concurrencies 512 1024 --num-prompts-per-concurrency 3 --level-timeout 20 --budget-s 105"}
i=0
for t in "$A" "$B" "$B" "$A"; do
  i=$((i + 1)); name=$([ "$t" = "$A" ] && echo a || echo b)
  echo "=== run $i: $name ($t) $(date +%T)" | tee -a "$R/cpu_sample.txt"
  args=$AB_ARGS; [ $i -gt 1 ] && args="$AB_ARGS --no-prime"
  # NOTE: run 1's priming start (counted in its --budget-s) takes 35-40 s on a fresh machine against ~15 s warm:
  # in the tenth session it left run 1's mask arm no time. Run 1 gets PRIME_EXTRA_S (default 30) more budget.
  budget=$(sed -n 's/.*--budget-s \([0-9.]*\).*/\1/p' <<< "$AB_ARGS")
  if [ $i -eq 1 ] && [ -n "$budget" ]; then
    args="$AB_ARGS --budget-s $(awk -v b="$budget" -v e="${PRIME_EXTRA_S:-30}" 'BEGIN { print b + e }')"
  fi
  (cd "$t" && AB_ARGS="$args" OUT="$R/ab$i-$name" bash tools/gpu_run.sh ab > /dev/null 2>&1)
  grep -A6 "^| concurrency" "$R/ab$i-$name/ab.txt" | head -7
done
kill "$CS" "$GS"
tar czf /tmp/gpu_ab_trees.tgz -C "$OUT" r && rm -rf "$R" && mv /tmp/gpu_ab_trees.tgz "$OUT/all.tgz"
