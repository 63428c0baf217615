#!/usr/bin/env bash
# Every GPU test and the GPU benchmarks, in one call on the GPU machine, from the repo root:
#   OUT=<results dir> bash scripts/gpu_run.sh
# Needs .gpu-pack/mlir-py312.tar.xz (bash ../shared/tools/pack-mlir-py312.sh .gpu-pack: the MLIR bindings
# for the machine's Python 3.12). Writes under $OUT: gpu-tests.xml and gpu-tests.log (pytest -m gpu),
# kernels.jsonl (benchmarks/kernels.py), gpt2_step.jsonl (benchmarks/gpt2_step.py, one process per
# configuration, plus a second jnova process on the same cache for the warm compile), gpu-summary.json.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
s=$(mktemp -d) && tar -xJf .gpu-pack/mlir-py312.tar.xz -C "$s" && export PYTHONPATH=$s:$PWD || exit 1
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin OUT
export JNOVA_SHA=${JNOVA_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export JNOVA_DIFF_PROFILE=${JNOVA_DIFF_PROFILE:-gpu}

python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu --junitxml="$OUT/gpu-tests.xml" \
  > "$OUT/gpu-tests.log" 2>&1
tests_rc=$?
tail -25 "$OUT/gpu-tests.log"

timeout 300 python3 benchmarks/kernels.py 2>&1 | grep -v Warning | tail -8
export JNOVA_CACHE_DIR=$(mktemp -d)  # shared by the two jnova float32 runs: the second is the warm compile
for dtype in float32 bfloat16; do
  for impl in jnova xla; do
    timeout 300 python3 benchmarks/gpt2_step.py --impl $impl --dtype $dtype > /dev/null 2>"$OUT/bench-$impl-$dtype.err" \
      || { echo "gpt2_step $impl $dtype failed:"; tail -5 "$OUT/bench-$impl-$dtype.err"; }
  done
done
timeout 300 python3 benchmarks/gpt2_step.py --impl jnova --dtype float32 --label warm > /dev/null 2>&1 \
  || echo "gpt2_step warm failed"
rm -f "$OUT"/bench-*.err
python3 benchmarks/summarize.py "$OUT" "$tests_rc"
exit "$tests_rc"
