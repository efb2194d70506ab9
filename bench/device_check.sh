#!/usr/bin/env bash
# The device check: what needs a CUDA GPU, in one run of under 8 minutes on one GPU.
#
#   bash bench/device_check.sh           # on a CUDA machine with the default model
#   bash bench/device_check.sh --bare    # on a lent GPU machine as it comes (below)
#   bash bench/device_check.sh --smoke   # on CPU with tiny sizes, as CI runs it (no rot)
#
# --bare: a machine with its own Python, PyTorch and transformers and no network, whose
# working tree came without .venv or the default model's GGUF. It installs the wheels
# bench/device_wheels.sh gathered into .whl/ (carried with the tree) and builds
# random-weight models at the default model's shape and at 1B there
# (bench/random_llama.py, outside the results: the 1B one is 2.2 GB).
#
# Steps (bench/device_bench.py's subcommands), each with its own time limit so one slow
# step cannot eat the others': 1. the `cuda`-marked tests, 2. the memory's bandwidth,
# 3. the engine on the 1B shape in bf16 at batch 1, 64 and 8, unconstrained and
# JSON-schema constrained, warm, steady decode timed with CUDA events, syncs per step
# counted, 4. transformers' generate() on the same model, static cache, forward compiled
# with reduce-overhead, warm, 5. the engine on the default model's shape, 6. the summary.
#
# Results: $OUT_DIR (default out/device_check; under $OUT, when that is set, as on a lent
# machine: what is written there comes back) holds every step's log, parts/ (each step's
# figures, written as it goes), steps.md (one line per step), figures.json and
# summary.md. Except with --smoke, figures.json and summary.md also go to docs/device/.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-cuda}
RESULTS=${OUT:-}
OUT=${OUT_DIR:-${RESULTS:+$RESULTS/device_check}}
OUT=${OUT:-out/device_check}
mkdir -p "$OUT"
PARTS="$OUT/parts"
rm -rf "$PARTS"
BENCH=bench/device_bench.py
CUDA_TESTS=$(grep -rl "pytest.mark.cuda" tests --include='test_*.py' | sort)

# Per step: the seconds it may take. --bare's add up to 405 s, about 7½ minutes with the set-up
# (wheels ~10 s, the random models ~30 s).
if [[ $MODE == --bare ]]; then
  PY=${PY:-python3}
  if [[ -d .whl ]]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/device-site .whl/*.whl || { echo "device_check: wheels failed"; exit 2; }
    export PYTHONPATH="/tmp/device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
PY=${PY:-python}
if [[ $MODE == --smoke ]]; then
  # The tiny random model of the tests for both shapes: every path runs, in about a
  # minute on 2 cores. generate() is not compiled here (over a minute a batch on CPU).
  DEVICE=cpu; DTYPE=auto; COMPILE=off; GEN_COMPILE=off; TOKENS=16
  BATCHES=1,2; JSON_BATCHES=2; SYNC_BATCHES=2; ORDER=1,2; GEN_BATCHES=1,2
  HBM_MIB=64; DOCS=""
  MODEL="$OUT/tiny-model"; MODEL_1B="$MODEL"
  PYTHONPATH="tests/support${PYTHONPATH:+:$PYTHONPATH}" $PY -c \
    "import sys; from tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])" \
    "$MODEL" >/dev/null 2>&1
  L_TESTS=120; L_HBM=60; L_ENGINE=180; L_GENERATE=180; L_DEFAULT=180; L_SUMMARY=60
else
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "device_check: no CUDA device (use --smoke on CPU)"; exit 2; }
  DEVICE=cuda; DTYPE=bfloat16; COMPILE=${ENGINE_COMPILE:-on}; GEN_COMPILE=on; TOKENS=64
  BATCHES=1,8,64; JSON_BATCHES=64,8; SYNC_BATCHES=64; ORDER=1,64,8; GEN_BATCHES=1,64,8
  HBM_MIB=1024; DOCS=docs/device
  if [[ $MODE == --bare ]]; then SHAPES=(default 1b); DIR=/tmp/device-models
  else SHAPES=(1b); DIR="$OUT/models"; fi
  MODELS=$($PY bench/random_llama.py "$DIR" "${SHAPES[@]}") || {
    echo "device_check: building the models failed"; exit 2; }
  MODEL_1B=$(echo "$MODELS" | tail -1)
  MODEL=default
  [[ $MODE == --bare ]] && MODEL=$(echo "$MODELS" | head -1)
  L_TESTS=60; L_HBM=20; L_ENGINE=110; L_GENERATE=150; L_DEFAULT=50; L_SUMMARY=15
fi

status=0
STEPS="$OUT/steps.md"
printf '| step | exit | seconds | last line |\n| --- | ---: | ---: | --- |\n' >"$STEPS"
step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "== $name"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -n 30
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - started)) s"
  local last
  last=$(grep -v -i warn "$OUT/$name.log" | grep -v '^\s*$' | tail -n 1 | tr '|' '/' | cut -c1-160)
  printf '| %s | %s | %s | %s |\n' "$name" "$rc" "$((SECONDS - started))" "$last" >>"$STEPS"
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then status=1; fi  # 5: pytest collected no test
}

# The default model's conversion, once per machine (~20 s on 16 cores), outside the rest.
[[ $MODEL == default ]] && step prepare 120 $PY -c \
  "from aici_cli.models import resolve_model; resolve_model(None)"
# shellcheck disable=SC2086  # the test files, one word each
step tests "$L_TESTS" $PY -m pytest -q -m cuda $CUDA_TESTS
step hbm "$L_HBM" $PY $BENCH hbm --parts "$PARTS" --device "$DEVICE" --mib "$HBM_MIB"
RUNS=(--device "$DEVICE" --dtype "$DTYPE" --tokens "$TOKENS" --parts "$PARTS")
step engine_one_b "$L_ENGINE" $PY $BENCH engine --model "$MODEL_1B" --name one_b \
  "${RUNS[@]}" --compile "$COMPILE" --batches "$BATCHES" --json-batches "$JSON_BATCHES" \
  --sync-batches "$SYNC_BATCHES" --order "$ORDER"
step generate_one_b "$L_GENERATE" $PY $BENCH generate --model "$MODEL_1B" --name one_b \
  "${RUNS[@]}" --compile "$GEN_COMPILE" --batches "$GEN_BATCHES"
step engine_default "$L_DEFAULT" $PY $BENCH engine --model "$MODEL" --name default \
  "${RUNS[@]}" --compile "$COMPILE" --batches "$BATCHES" --json-batches "${JSON_BATCHES%%,*}" \
  --sync-batches "" --order "$ORDER"
WRITE=(--write "$OUT")
[[ -n $DOCS ]] && WRITE+=(--write "$DOCS")
step summary "$L_SUMMARY" $PY $BENCH summary --parts "$PARTS" --tests-log "$OUT/tests.log" \
  --steps "$STEPS" --mode="${1:-}" "${WRITE[@]}"
echo "device_check: $([[ $status -eq 0 ]] && echo passed || echo FAILED) (logs in $OUT)"
cat "$STEPS"
exit $status
