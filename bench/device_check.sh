#!/usr/bin/env bash
# The device check: what needs a CUDA GPU, in one run of under 8 minutes on one GPU.
#
#   bash bench/device_check.sh           # on a CUDA machine: results in out/device_check/
#   bash bench/device_check.sh --smoke   # on CPU with tiny sizes, as CI runs it (no rot)
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

if [[ "${1:-}" == "--smoke" ]]; then
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
step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -n 30
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - started)) s"
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
for c in ${COMPILES//,/ }; do
  step "generate_compare_$c" "$LIMIT" $PY bench/generate_compare.py --device "$DEVICE" \
    --model "$([[ $MODEL == default ]] || echo "$MODEL")" \
    --quantize "$QUANT" --batch-sizes "$BATCHES" --max-tokens "$TOKENS" --compile "$c" \
    --out "$OUT/generate_compare_$c.json"
done
echo "device_check: $([[ $status -eq 0 ]] && echo passed || echo FAILED) (logs in $OUT)"
exit $status
