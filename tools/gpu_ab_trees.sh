#!/usr/bin/env bash
# The serving A/B of two or more source trees side by side in one device call (code changes against the code
# before them): runs `tools/gpu_run.sh ab` in each tree, then in each again in reverse order (A B B A; with three
# trees A B C C B A: drift of the machine falls on every side), with a per-thread CPU sample
# (tools/cpu_sample.py) over all runs, and packs everything into $OUT/all.tgz.
#   device run: bash tools/gpu_ab_trees.sh .snap/old .snap/new [.snap/new2 ...]  (carry .snap; .whl in one tree;
#   tools/snap_trees.sh makes .snap from git revisions)
# AB_ARGS as for gpu_run.sh (default: no-mask and mask at 512 and 1024 streams, 3 prompts per stream); runs after
# the first get --no-prime (the first run's priming start fills the machine's kernel caches for all; that run
# gets PRIME_EXTRA_S more --budget-s for it). TEST_PATHS: if set, each tree after the first runs its CUDA tests
# first (a branch's first call and its A/B in one; logs in r/tests_<name>.txt; tests/v1/engine needs more than
# 110 s on the H200). Run directories are r/ab<i>-<name>, name a for the first tree, b, c, ... for the others.
set -u
[ $# -ge 2 ] || { echo "usage: $0 TREE_A TREE_B [TREE_C ...]" >&2; exit 2; }
trees=(); for t in "$@"; do trees+=("$(cd "$t" && pwd)"); done
names=(a b c d e f g h)
OUT=${OUT:-out}; mkdir -p "$OUT/r"; OUT=$(cd "$OUT" && pwd); R=$OUT/r
HERE=$(cd "$(dirname "$0")" && pwd)
for t in "${trees[@]}"; do
  if [ ! -d /tmp/site/msgspec ] && ls "$t"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$t"/.whl/*.whl
  fi
done
if [ -n "${TEST_PATHS:-}" ]; then
  for k in $(seq 1 $((${#trees[@]} - 1))); do
    t=${trees[$k]}; log=$R/tests_${names[$k]}.txt
    echo "=== tests (${names[$k]}: $t) $(date +%T)"
    (cd "$t" && PYTHONPATH=/tmp/site:$t PYTHONUNBUFFERED=1 timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q \
      -p no:cacheprovider --tb=short -rfE $TEST_PATHS > "$log" 2>&1; echo "pytest rc=$?" >> "$log"
      tail -5 "$log")  # NOTE: pyproject's addopts has -q: with this one no summary line, hence the rc
  done
fi
python3 "$HERE/cpu_sample.py" --interval 2 --top 24 > "$R/cpu_sample.txt" 2>&1 & CS=$!
bash "$HERE/gpu_sample.sh" 2 > "$R/gpu_sample.csv" 2>&1 & GS=$!
AB_ARGS=${AB_ARGS:-"--arms no-mask mask --concurrencies 512 1024 --num-prompts-per-concurrency 3 --level-timeout 20 --budget-s 105"}
i=0
order=(); for k in "${!trees[@]}"; do order+=("$k"); done
for ((k = ${#trees[@]} - 1; k >= 0; k--)); do order+=("$k"); done
for k in "${order[@]}"; do
  t=${trees[$k]}; i=$((i + 1)); name=${names[$k]}
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
kill "$CS" "$GS" 2>/dev/null
tar czf /tmp/gpu_ab_trees.tgz -C "$OUT" r && rm -rf "$R" && mv /tmp/gpu_ab_trees.tgz "$OUT/all.tgz"
