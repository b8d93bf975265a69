#!/usr/bin/env bash
# The GPU's SM and memory clocks, power, temperature and clock-event (throttle) reasons every ${1:-2} s, as CSV on
# stdout, until killed; read only (nvidia-smi's queries change nothing). Run next to a benchmark by
# tools/gpu_run.sh (CPU_SAMPLE=1) and tools/gpu_ab_trees.sh: a level whose device step runs slower shows why here.
q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
# NOTE: the reasons' field was renamed (clocks_throttle_reasons -> clocks_event_reasons); take whichever this
# driver knows, else none.
for f in clocks_event_reasons.active clocks_throttle_reasons.active; do
  if nvidia-smi --query-gpu=$f --format=csv,noheader > /dev/null 2>&1; then q=$q,$f; break; fi
done
exec nvidia-smi --query-gpu=$q --format=csv -l "${1:-2}"
