#!/bin/bash
# The CUDA paths of roll on one GPU: the tests without Ray on cuda/nccl, a benchmark, then the main job.
#
# For a GPU machine with PyTorch and transformers but no network and no Ray (the local executor
# needs none). Put the missing wheels in .whl/ first (Python 3.12, x86-64):
#   pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions, hjson,
#   megatron-core==0.16.1, and deepspeed==0.19.8 built from its source (`pip wheel --no-deps
#   --no-binary deepspeed deepspeed==0.19.8`: a pure-Python wheel whose CUDA ops compile on first use).
# Then, from the repository root:  OUT=/tmp/gpu bash scripts/gpu_check.sh
# Every test not marked ray runs (pytest-xdist, WORKERS processes, default 12; tests that need a
# package the machine lacks are skipped or fail to collect); junit.xml lists each outcome.
# NO_TESTS=1 skips the tests, NO_BENCH=1 the packed-attention benchmark, NO_RUN=1 the main job; RUN_S (seconds, default 420)
# bounds the main job; RUN_ARGS adds overrides; PYTEST_ARGS replaces the test selection (split on spaces:
# deselect with --deselect, or pass a -k expression that has spaces in PYTEST_K).
# VS_TRL="ARGS" runs benchmarks/vs_trl.py --executor local --device cuda ARGS first (VS_TRL_S seconds, default
# 240), e.g. VS_TRL="--size large --seeds 42 --large-steps 6 --precision bf16"; it needs trl==1.16.0,
# datasets, dill and multiprocess in .whl/ too (the machine has accelerate, pandas, pyarrow and the rest).
# SAMPLER=1 runs benchmarks/bench_next_token.py and bench_sampling.py (95M, vocabulary 151,936, top-p 0.9)
# with --device cuda after it (SAMPLER_S seconds each, default 60 and 90).
# CUDNN=1 runs benchmarks/bench_cudnn_attention.py (bf16 with cuDNN's attention on and off; CUDNN_S, default 90).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
  . plugins/roll_megatron plugins/roll_deepspeed || exit 1
rm -rf build plugins/*/build
export PYTHONPATH=/tmp/site
python3 -c "import torch, transformers, deepspeed, megatron.core as m; print('torch', torch.__version__,
  'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'megatron-core', m.__version__)" \
  2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
python3 -m roll_core.cli list-plugins 2>&1 | tee -a "$OUT/gpu.txt"
if [ -n "$VS_TRL" ]; then
  timeout "${VS_TRL_S:-240}" python3 benchmarks/vs_trl.py --executor local --device cuda $VS_TRL 2>&1 \
    | grep -v "Loading\|Writing\|arn" | tee "$OUT/vs_trl.txt"
fi
if [ -n "$SAMPLER" ]; then  # the decoding step's sampling at Qwen2.5's vocabulary: one step, then whole generate calls
  timeout "${SAMPLER_S:-60}" python3 benchmarks/bench_next_token.py --device cuda --rounds 20 2>&1 \
    | tee "$OUT/bench_next_token.txt"
  timeout "${SAMPLER_S:-90}" python3 benchmarks/bench_sampling.py --device cuda --size large --vocab 151936 \
    --top-p 0.9 --new-tokens 32 --repeats 3 2>&1 | grep -v "Loading" | tee "$OUT/bench_sampling.txt"
fi
if [ -n "$CUDNN" ]; then
  timeout "${CUDNN_S:-90}" python3 benchmarks/bench_cudnn_attention.py 2>&1 | grep -v "Loading\|Writing\|arn" \
    | tee "$OUT/bench_cudnn_attention.txt"
fi
if [ -z "$NO_BENCH" ]; then
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_packed_attention.py --rounds 4 2>&1 | grep -v "Warning\|warn" \
    | tee "$OUT/bench_packed_attention.txt"
fi
if [ -z "$NO_RUN" ]; then
  /usr/bin/time -v timeout "${RUN_S:-420}" python3 -m roll_core.cli run executor=local output_dir=/tmp/gpu-run $RUN_ARGS \
    2>&1 | tee "$OUT/run.txt" | grep -v "^\s*$" | tail -12
fi
if [ -z "$NO_TESTS" ]; then
  timeout "${TESTS_S:-300}" python3 -m pytest -p no:cacheprovider -q -rfE -m "not ray and not slow" -o addopts="" \
    -W ignore::DeprecationWarning -n "${WORKERS:-12}" --continue-on-collection-errors --junitxml="$OUT/junit.xml" \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-tests plugins/roll_deepspeed/tests plugins/roll_megatron/tests} 2>&1 | tee "$OUT/pytest.txt" \
    | grep -v "Warning\|warn" | tail -60
fi
