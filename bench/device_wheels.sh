#!/usr/bin/env bash
# The wheels a bare GPU machine lacks for the device check (bench/device_check.sh --bare),
# gathered here for its Python (3.12, manylinux x86-64) at the versions this checkout's
# .venv runs: the machine has PyTorch, transformers, tokenizers, safetensors, numpy,
# click, rich, jinja2, regex, hypothesis and pytest, and no network.
#
#   bash bench/device_wheels.sh [DIR]     # default .whl/ (ignored by git): ~20 MB
#
# The folder travels with the working tree (the device tool's `carry`), and
# `device_check.sh --bare` installs it with `pip install --no-index --target`.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DIR"
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for name in llguidance wasmtime gguf jsonschema referencing jsonschema-specifications \
    rpds-py; do
  version=$("$PIP" show "$name" | awk '/^Version:/ {print $2}')
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" "$name==$version"
done
du -sh "$DIR"
