#!/usr/bin/env bash
# Snapshots of git revisions for tools/gpu_ab_trees.sh, on this machine before the device call: each REV is
# `git archive`d into .snap/<n>-<rev with / as _> (numbered in the order given, which is the A/B's tree order),
# and .whl (the device's wheels, from the shared fetch-gpu-wheels.sh) is copied into the first. Prints the
# directories, ready for `bash tools/gpu_ab_trees.sh $(bash tools/snap_trees.sh main wip/x)` (carry .snap).
#   bash tools/snap_trees.sh main wip/wire-trims wip/host-group wip/single-wait
# A tree is ~11 MB, 9 of them the bundled model (vllm/assets/tiny-llama), and the device call carries 64 MiB
# with the working tree: SNAP_NO_MODEL=1 leaves the model out of every tree but the first (the serving A/B runs
# dummy weights; CUDA tests that load the bundled model then fail in those trees).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 REV_A REV_B [REV_C ...]" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
rm -rf .snap && mkdir -p .snap
n=0
for rev in "$@"; do
  n=$((n + 1)); dir=.snap/$n-${rev//\//_}
  paths=(); [ $n -gt 1 ] && [ "${SNAP_NO_MODEL:-0}" = 1 ] && paths=(-- . ':(exclude)vllm/assets/tiny-llama')
  mkdir -p "$dir" && git archive "$rev" "${paths[@]}" | tar x -C "$dir"
  [ $n -eq 1 ] && [ -d .whl ] && cp -r .whl "$dir/"
  echo "$dir"
done
echo "snap_trees: $(du -sm .snap | cut -f1) MB in .snap (the call carries 64 MiB with the working tree)" >&2
