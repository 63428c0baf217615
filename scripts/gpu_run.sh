#!/usr/bin/env bash
# Every GPU test and the GPU benchmarks, on the GPU machine, from the repo root:
#   OUT=<results dir> bash scripts/gpu_run.sh [tests] [differential] [matmul] [attention] [bench] [dispatch] [profile] [hostprofile]
#                                             [dp] [compare] [parity]
# (no argument: tests differential matmul bench dispatch). TESTS=<pytest paths> narrows the tests part,
# MATMUL_ARGS are passed to benchmarks/matmul.py, DISPATCH_ARGS to benchmarks/dispatch.py, STEP_DTYPES (default "float32 bfloat16") to the steps.
# A device call runs at most 10 minutes, so the parts can go in separate calls (same $OUT layout). Set
# JNOVA_SHA=<commit> for the records: a copied tree's git metadata may name an older commit.
# Needs .gpu-pack/mlir-py312.tar.xz (bash ../shared/tools/pack-mlir-py312.sh .gpu-pack: the MLIR bindings
# for the machine's Python 3.12). Writes under $OUT:
#   tests:        gpu-tests.xml, gpu-tests.log (pytest -m gpu, all but the random programs; 4 workers)
#   differential: differential.xml, differential.log, differential.jsonl (>= 1000 random programs, one
#                 JSON line per shard: programs, kernels, XLA groups, failures, seconds; 15 workers)
#   matmul:       matmul.jsonl (benchmarks/matmul.py: the nine contraction shapes, jnova vs XLA, TFLOP/s)
#   attention:    attention.jsonl (benchmarks/attention.py --check --bench: causal attention, jnova vs XLA
#                 vs cuDNN, ms and TFLOP/s); ATTENTION_ARGS replace those flags
#   bench:        kernels.jsonl (benchmarks/kernels.py), gpt2_step.jsonl (benchmarks/gpt2_step.py, one process
#                 per configuration, plus a second jnova process on the same caches: the warm compile; its
#                 dispatch_ms varies by up to 1.5x between processes: the dispatch part measures the ratio)
#   dispatch:     dispatch.jsonl (benchmarks/dispatch.py: host dispatch of the GPT-2 step, jnova and XLA
#                 interleaved in one process; f32 and bf16 at 8 x 1024 tokens, f32 at 1 x 64)
#   profile:      profile-{jnova,xla}-float32.json (benchmarks/profile_step.py: GPU time per kernel family)
#   dp:           gpt2_dp.jsonl, buckets-*.txt, trace-*/ (benchmarks/gpt2_dp.py on 1 and 2 GPUs: jnova's
#                 bucketed shard_map step, XLA's pmap with and without its latency-hiding scheduler; DP_DTYPES)
#   hostprofile:  host_profile.json (benchmarks/host_profile.py: host time per event of a step, jnova and XLA,
#                 at 1 x 64 tokens where dispatch is most of the step)
#   compare:      gpt2_compare.jsonl, gpt2_compare.md (benchmarks/compare.py: GPT-2 124M, jnova vs jax.jit and
#                 torch.compile, f32 / bf16 / bf16 + cuDNN; COMPARE_ARGS, default --quick: batch 8, ~6 min;
#                 the full set as two calls: COMPARE_ARGS="--batch 8" then "--batch 16", same $OUT)
#   parity:       parity/ (examples/gpt2/parity.py --parallel: GPT-2 124M on Shakespeare, 300 steps x 2 seeds x
#                 2 compilers, the four runs at once, ~2 min; their files in parity/runs.tgz; gpt2_parity.md
#                 says whether the compilers' gap is below the seeds'). Needs the tokenized shards in
#                 .gpu-pack/shakespeare (python examples/gpt2/data.py shakespeare --out .gpu-pack/shakespeare,
#                 3.6 MB); PARITY_ARGS are passed on.
#   The charts of compare and parity need matplotlib: where it is missing, run `python benchmarks/compare.py
#   --report-only --out $OUT` and `python examples/gpt2/parity.py --report-only --out $OUT/parity` elsewhere.
#   gpu-summary.json (benchmarks/summarize.py) after each part.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
parts=${*:-tests differential matmul bench dispatch}
s=$(mktemp -d) && tar -xJf .gpu-pack/mlir-py312.tar.xz -C "$s" && export PYTHONPATH=$s:$PWD || exit 1
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin OUT XLA_PYTHON_CLIENT_PREALLOCATE=false
export JNOVA_SHA=${JNOVA_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export JNOVA_DIFF_PROFILE=${JNOVA_DIFF_PROFILE:-gpu}
rc=0

if [[ " $parts " == *" tests "* ]]; then
  timeout ${TESTS_TIMEOUT:-570} python3 -m pytest -m gpu -q -rfEsP -n 4 -p no:cacheprovider ${TESTS:-tests/gpu} \
    -k "not random_programs" \
    --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1 || rc=1
  tail -15 "$OUT/gpu-tests.log"
fi

if [[ " $parts " == *" differential "* ]]; then
  rm -f "$OUT/differential.jsonl"
  JNOVA_DIFF_REPORT="$OUT/differential.jsonl" python3 -m pytest -m gpu -q -n 15 -p no:cacheprovider \
    tests/gpu/test_gpu_differential.py -k random_programs --junitxml="$OUT/differential.xml" \
    > "$OUT/differential.log" 2>&1 || rc=1
  grep -E "passed|failed" "$OUT/differential.log" | tail -3
fi

if [[ " $parts " == *" profile "* ]]; then
  for impl in jnova xla; do
    timeout 200 python3 benchmarks/profile_step.py --impl $impl --dtype float32 2>&1 | grep -v -i warning | head -16
  done
fi

if [[ " $parts " == *" attention "* ]]; then
  timeout ${ATTENTION_TIMEOUT:-540} python3 benchmarks/attention.py ${ATTENTION_ARGS:---check --bench} 2>&1 \
    | grep -v -i warning | tail -80
fi

if [[ " $parts " == *" matmul "* ]]; then
  timeout ${MATMUL_TIMEOUT:-420} python3 benchmarks/matmul.py ${MATMUL_ARGS:-} 2>&1 | grep -v -i warning | tail -60
fi

if [[ " $parts " == *" bench "* ]]; then
  [[ -n "${SKIP_KERNEL_BENCH:-}" ]] || timeout 300 python3 benchmarks/kernels.py 2>&1 | grep -v Warning | tail -8
  # the jnova float32 runs share jnova's cache and, through jnova.enable_xla_cache, JAX's compilation
  # cache: the first is the cold compile, the last (label "warm") a second process finding both
  export JNOVA_CACHE_DIR=$(mktemp -d)
  for dtype in ${STEP_DTYPES:-float32 bfloat16}; do
    for impl in jnova xla; do
      timeout 300 python3 benchmarks/gpt2_step.py --impl $impl --dtype $dtype --xla-cache > /dev/null \
        2>"$OUT/bench-$impl-$dtype.err" || { echo "gpt2_step $impl $dtype failed:"; tail -5 "$OUT/bench-$impl-$dtype.err"; }
    done
  done
  timeout 300 python3 benchmarks/gpt2_step.py --impl jnova --dtype float32 --xla-cache --label warm > /dev/null 2>&1 \
    || echo "gpt2_step warm failed"
  rm -f "$OUT"/bench-*.err
fi

if [[ " $parts " == *" dispatch "* ]]; then
  for dtype in ${STEP_DTYPES:-float32 bfloat16}; do
    timeout 300 python3 benchmarks/dispatch.py --dtype $dtype --rounds ${DISPATCH_ROUNDS:-40} ${DISPATCH_ARGS:-} 2>/dev/null \
      | grep -E "ratio|launcher" || echo "dispatch $dtype failed"
  done
  timeout 240 python3 benchmarks/dispatch.py --dtype float32 --batch 1 --seq 64 --rounds 100 --label probe 2>/dev/null \
    | grep -E "ratio|launcher" || echo "dispatch probe failed"
fi

if [[ " $parts " == *" dp "* ]]; then  # needs two GPUs (nvidia-h200-x2); one dtype per call fits 10 minutes
  for dtype in ${DP_DTYPES:-bfloat16}; do
    for devices in 1 2; do
      for impl in "jnova" "xla" "xla --latency-hiding"; do
        timeout 150 python3 benchmarks/gpt2_dp.py --impl $impl --devices $devices --dtype $dtype \
          $([[ $devices == 2 && $impl != "xla" ]] && echo --trace) 2>&1 | grep -E '"tok_s"|overlapped_fraction' \
          || echo "gpt2_dp $impl D$devices $dtype failed"
      done
    done
  done
  python3 benchmarks/gpt2_dp.py --summarize "$OUT/gpt2_dp.jsonl"
fi

if [[ " $parts " == *" hostprofile "* ]]; then
  timeout 240 python3 benchmarks/host_profile.py --dtype float32 2>&1 | grep -v -i warning | tail -70
fi

if [[ " $parts " == *" compare "* ]]; then
  timeout ${COMPARE_TIMEOUT:-580} python3 benchmarks/compare.py ${COMPARE_ARGS:---quick} --out "$OUT" 2>&1 \
    | grep -v -i warning | tail -40 || rc=1
fi

if [[ " $parts " == *" parity "* ]]; then
  timeout ${PARITY_TIMEOUT:-580} python3 examples/gpt2/parity.py ${PARITY_ARGS:---parallel} --out "$OUT/parity" 2>&1 \
    | grep -v -i warning | tail -20 || rc=1
  # the runs' own files (csv, json, log, curves) in one archive: a device call returns at most 8 files
  (cd "$OUT/parity" && ls | grep -v '^gpt2_parity\.' | tar -czf runs.tgz --remove-files -T -) || rc=1
fi

python3 benchmarks/summarize.py "$OUT" "$rc"
exit "$rc"
