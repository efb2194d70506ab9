#!/usr/bin/env bash
# The device check: what needs a CUDA GPU, in one run of under 8 minutes on one GPU.
#
#   bash bench/device_check.sh           # on a CUDA machine: results in out/device_check/
#   bash bench/device_check.sh --bare    # on a lent GPU machine as it comes (below)
#   bash bench/device_check.sh --smoke   # on CPU with tiny sizes, as CI runs it (no rot)
#
# --bare: a machine with its own Python, PyTorch and transformers and no network, whose
# working tree came without .venv or the default model's GGUF. It installs the wheels
# bench/device_wheels.sh gathered into .whl/ (carried with the tree), builds random-weight
# models at the default model's shape and at 1B there (bench/random_llama.py), and runs
# the steps on them. Every mode writes $OUT/summary.md: one line per step.
#
# 1. the CUDA-marked tests (int4 logits near bf16 on CUDA, compiled = eager tokens with
#    CUDA graphs), 2. bench/step_profile.py at bf16 and int4, batch 1, 8 and 64,
#    3. the engine against plain generate() at bf16 and int4, batch 1, 8 and 64 (eager and
#    compiled). Each step has its own time limit so one slow step cannot eat the others'.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT_DIR:-out/device_check}
mkdir -p "$OUT"

MODEL_1B=""
if [[ "${1:-}" == "--bare" ]]; then
  PY=${PY:-python3}
  if [[ -d .whl ]]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/device-site .whl/*.whl || { echo "device_check: wheels failed"; exit 2; }
    export PYTHONPATH="/tmp/device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "device_check: no CUDA device"; exit 2; }
  # Fewer lines than with a real model: a batch-1 run of 64 lines of 64 tokens outran
  # its minute on the lent H200 (~15 ms a step, its 16 cores shared).
  DEVICE=cuda; BATCHES=1,8,64; LINES=16; TOKENS=64; QUANT=none,int4; LIMIT=60
  MODELS=$($PY bench/random_llama.py "$OUT/models" default 1b) || {
    echo "device_check: building the models failed"; exit 2; }
  MODEL=$(echo "$MODELS" | head -1); MODEL_1B=$(echo "$MODELS" | tail -1)
  TESTS=(-m cuda)
  COMPILES=off,on
elif [[ "${1:-}" == "--smoke" ]]; then
  # The tiny random model of the tests: every step runs, in about a minute on 2 cores.
  DEVICE=cpu; BATCHES=1,2; LINES=2; TOKENS=64; QUANT=none,int4; LIMIT=300
  MODEL="$OUT/tiny-model"
  PYTHONPATH="tests/support${PYTHONPATH:+:$PYTHONPATH}" $PY -c \
    "import sys; from tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])" \
    "$MODEL" >/dev/null 2>&1
  TESTS=(-m cuda)          # collected and skipped without CUDA: the markers stay valid
  COMPILES=off
else
  DEVICE=cuda; BATCHES=1,8,64; LINES=64; TOKENS=64; QUANT=none,int4; LIMIT=70
  MODEL=default
  TESTS=(-m cuda)
  COMPILES=off,on
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "device_check: no CUDA device (use --smoke on CPU)"; exit 2; }
fi

status=0
SUMMARY="$OUT/summary.md"
printf '# device check (%s)\n\n| step | exit | seconds | last line |\n| --- | ---: | ---: | --- |\n' \
  "${1:-cuda}" >"$SUMMARY"
step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -n 30
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - started)) s"
  local last
  last=$(grep -v -i warn "$OUT/$name.log" | grep -v '^\s*$' | tail -n 1 | tr '|' '/' | cut -c1-160)
  printf '| %s | %s | %s | %s |\n' "$name" "$rc" "$((SECONDS - started))" "$last" >>"$SUMMARY"
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then status=1; fi  # 5: pytest collected no test
}

# The default model's conversion, once per machine (~20 s on 16 cores), outside the rest.
[[ $MODEL == default ]] && step prepare 120 $PY -c \
  "from aici_cli.models import resolve_model; resolve_model(None)"
step tests "$LIMIT" $PY -m pytest -q "${TESTS[@]}" tests/models/quant/test_quantize.py \
  tests/engine/forward/test_compiled_decode.py
for q in ${QUANT//,/ }; do
  step "step_profile_$q" "$LIMIT" $PY bench/step_profile.py --models "$MODEL" \
    --device "$DEVICE" --quantize "$q" --batch-sizes "$BATCHES" --lines "$LINES" \
    --max-tokens "$TOKENS" --out "$OUT/step_profile_$q.json"
done
if [[ -n $MODEL_1B ]]; then
  step step_profile_1b_int4 "$LIMIT" $PY bench/step_profile.py --models "$MODEL_1B" \
    --device "$DEVICE" --quantize int4 --batch-sizes 1,8 --lines 8 \
    --max-tokens "$TOKENS" --out "$OUT/step_profile_1b_int4.json"
fi
for c in ${COMPILES//,/ }; do
  step "generate_compare_$c" "$LIMIT" $PY bench/generate_compare.py --device "$DEVICE" \
    --model "$([[ $MODEL == default ]] || echo "$MODEL")" \
    --quantize "$QUANT" --batch-sizes "$BATCHES" --max-tokens "$TOKENS" --compile "$c" \
    --out "$OUT/generate_compare_$c.json"
done
echo "device_check: $([[ $status -eq 0 ]] && echo passed || echo FAILED) (logs in $OUT)"
cat "$SUMMARY"
exit $status
