#!/usr/bin/env bash
# A branch's first GPU call, against the tree before it: the NEW tree's CUDA tests (TEST_PATHS), then the kernel
# profile (tools/gpu_kernel_profile.py, mask off vs on with the JSON kernels in the sampler graph) of OLD and of
# NEW at the same rows, so that each kernel's change reads side by side; everything packed into $OUT/all.tgz.
#   device run: bash tools/gpu_branch_check.sh .snap/old .snap/new   (carry both; .whl inside one of the trees)
# ~5 min at the defaults. The serving A/B of the two trees is tools/gpu_ab_trees.sh (its own call).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd)
OUT=${OUT:-out}; mkdir -p "$OUT/r"; OUT=$(cd "$OUT" && pwd); R=$OUT/r
for t in "$A" "$B"; do
  if [ ! -d /tmp/site/msgspec ] && ls "$t"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$t"/.whl/*.whl
  fi
done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
TEST_PATHS=${TEST_PATHS:-"tests/v1/sample tests/v1/worker/test_cudagraph.py tests/v1/worker/test_mixed_cudagraph.py"}
KPROF_ARGS=${KPROF_ARGS:-"--rows 256 1024 --steps 20 --mask-text"}
echo "=== tests (new) $(date +%T)"
(cd "$B" && PYTHONPATH=/tmp/site:$B timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE $TEST_PATHS \
  > "$R/tests_new.txt" 2>&1; tail -5 "$R/tests_new.txt")
for side in old new; do
  t=$([ $side = old ] && echo "$A" || echo "$B")
  echo "=== kernel profile ($side) $(date +%T)"
  mkdir -p "$R/kprof_$side"
  (cd "$t" && PYTHONPATH=/tmp/site:$t python3 tools/gpu_kernel_profile.py $KPROF_ARGS --out "$R/kprof_$side" 2>&1 \
    | grep -v -e Warning -e USDT > "$R/kprof_$side.txt"; grep -A12 "ms per step (mask off / mask on)" "$R/kprof_$side.txt" \
    | grep -e "^###" -e wall -e "device busy" -e "topk" -e "mask kernels")
done
tar czf /tmp/gpu_branch_check.tgz -C "$OUT" r && rm -rf "$R" && mv /tmp/gpu_branch_check.tgz "$OUT/all.tgz"
