#!/usr/bin/env bash
# Builds test_int_dot.c and test_rows_attention.c with each variant and runs them: the
# x86 variants natively where this CPU has their instructions (/proc/cpuinfo), the
# AArch64 ones cross-compiled and run under qemu-aarch64. Every int_dot program links the
# generic variant too (the reference); the attention test has a float64 model of its own.
#
#   build_and_test.sh [-o DIR] [VARIANT...]
#
# VARIANTs: generic avx2 avx_vnni avx512_vnni neon_dot neon. Without any: each one this
# machine can build and run, the others skipped with a line saying why. A VARIANT named
# explicitly that cannot run here fails. Exit status: 0 when every run passed.
#   neon_dot: -march=armv8.2-a+dotprod, with the plain build linked in as well; qemu -cpu max
#   neon:     -march=armv8-a, under qemu -cpu cortex-a53 (no dot product: an sdot that
#             slipped into this build would stop it with SIGILL)
# Programs go to DIR (default: a temporary folder, removed). Overrides: CC, ARM_CC,
# QEMU_AARCH64, ARM_SYSROOT, SEED (the test's random seed). About 1 s a variant natively,
# a few under qemu.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out=""
if [[ "${1:-}" == "-o" ]]; then out="$2"; shift 2; fi
if [[ -z "$out" ]]; then out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT; fi
mkdir -p "$out"

CC="${CC:-gcc}"
ARM_CC="${ARM_CC:-aarch64-linux-gnu-gcc}"
QEMU_AARCH64="${QEMU_AARCH64:-qemu-aarch64}"
ARM_SYSROOT="${ARM_SYSROOT:-/usr/aarch64-linux-gnu}"
SEED="${SEED:-20240501}"
# -std=c11: no multiply-add fused beyond the explicit ones (GNU modes contract a*b+c).
COMMON=(-std=c11 -O2 -Wall -Wextra -I"$here")

declare -A ISA=(
  [avx2]="-mavx2 -mfma -mf16c"
  [avx_vnni]="-mavx2 -mavxvnni -mf16c -mfma"
  [avx512_vnni]="-mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma"
)
declare -A CPU_FLAGS=(  # as /proc/cpuinfo names them
  [avx2]="avx2 fma f16c"
  [avx_vnni]="avx2 avx_vnni f16c fma"
  [avx512_vnni]="avx2 avx512f avx512bw avx512vl avx512_vnni f16c fma"
)
declare -A SOURCE=([avx2]=x86_avx2.c [avx_vnni]=x86_avx_vnni.c [avx512_vnni]=x86_avx512_vnni.c)

cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "

# Why VARIANT cannot be built and run here, or nothing.
why_not() {
  case "$1" in
    generic) command -v "$CC" >/dev/null || echo "no $CC" ;;
    avx2 | avx_vnni | avx512_vnni)
      [[ "$(uname -m)" == x86_64 ]] || { echo "not an x86-64 machine"; return; }
      command -v "$CC" >/dev/null || { echo "no $CC"; return; }
      local missing=()
      for f in ${CPU_FLAGS[$1]}; do [[ "$cpu_flags" == *" $f "* ]] || missing+=("$f"); done
      ((${#missing[@]} == 0)) || echo "the CPU lacks ${missing[*]}" ;;
    neon_dot | neon)
      command -v "$ARM_CC" >/dev/null || { echo "no $ARM_CC (crossbuild-essential-arm64)"; return; }
      command -v "$QEMU_AARCH64" >/dev/null || echo "no $QEMU_AARCH64 (qemu-user)" ;;
    *) echo "unknown variant (generic avx2 avx_vnni avx512_vnni neon_dot neon)" ;;
  esac
}

# rows_attention.c's flags beyond the variant's (int_mm.py ATTENTION_FLAGS).
ATTENTION=(-fassociative-math -fno-signed-zeros -fno-trapping-math -fno-math-errno
           -ffinite-math-only)

# test_rows_attention.c against rows_attention.c built with the variant's flags: $1 the
# compiler, $2 the variant, $3 its flags (one word list), then the command that runs it.
attention_test() {
  local cc="$1" v="$2" flags="$3" exe="$out/test_rows_attention_$2"
  shift 3
  # shellcheck disable=SC2086  # flags is a list
  "$cc" "${COMMON[@]}" $flags "${ATTENTION[@]}" -c -o "$out/rows_attention_$v.o" \
      "$here/rows_attention.c" &&
    "$cc" "${COMMON[@]}" -o "$exe" "$here/test_rows_attention.c" "$out/rows_attention_$v.o" -lm &&
    "$@" "$exe" "$v" "$SEED"
}

build_and_run() {
  local v="$1" exe="$out/test_int_dot_$1"
  case "$v" in
    generic)
      "$CC" "${COMMON[@]}" -o "$exe" "$here/test_int_dot.c" "$here/generic.c" -lm &&
        "$exe" "$SEED" && attention_test "$CC" "$v" "" ;;
    avx2 | avx_vnni | avx512_vnni)
      # Each with the AVX2 quantiser every x86 variant's operator calls (x86_quantise.c).
      # shellcheck disable=SC2086  # ISA is a list of flags
      "$CC" "${COMMON[@]}" ${ISA[$v]} -c -o "$out/$v.o" "$here/${SOURCE[$v]}" &&
        "$CC" "${COMMON[@]}" ${ISA[avx2]} -c -o "$out/x86_quantise.o" "$here/x86_quantise.c" &&
        "$CC" "${COMMON[@]}" -DAICI_TEST_"${v^^}" -DAICI_TEST_X86_QUANTISE -o "$exe" \
          "$here/test_int_dot.c" "$here/generic.c" "$out/$v.o" "$out/x86_quantise.o" -lm &&
        "$exe" "$SEED" && attention_test "$CC" "$v" "${ISA[$v]}" ;;
    neon_dot)
      "$ARM_CC" "${COMMON[@]}" -march=armv8-a -c -o "$out/neon.o" "$here/arm_neon.c" &&
        "$ARM_CC" "${COMMON[@]}" -march=armv8.2-a+dotprod -c -o "$out/neon_dot.o" \
          "$here/arm_neon.c" &&
        "$ARM_CC" "${COMMON[@]}" -march=armv8-a -DAICI_TEST_NEON_DOT -DAICI_TEST_NEON \
          -o "$exe" "$here/test_int_dot.c" "$here/generic.c" "$out/neon_dot.o" "$out/neon.o" -lm &&
        "$QEMU_AARCH64" -cpu max -L "$ARM_SYSROOT" "$exe" "$SEED" &&
        attention_test "$ARM_CC" "$v" "-march=armv8.2-a+dotprod" \
          "$QEMU_AARCH64" -cpu max -L "$ARM_SYSROOT" ;;
    neon)
      "$ARM_CC" "${COMMON[@]}" -march=armv8-a -DAICI_TEST_NEON -o "$exe" \
        "$here/test_int_dot.c" "$here/generic.c" "$here/arm_neon.c" -lm &&
        "$QEMU_AARCH64" -cpu cortex-a53 -L "$ARM_SYSROOT" "$exe" "$SEED" &&
        attention_test "$ARM_CC" "$v" "-march=armv8-a" \
          "$QEMU_AARCH64" -cpu cortex-a53 -L "$ARM_SYSROOT" ;;
  esac
}

explicit=1
variants=("$@")
if ((${#variants[@]} == 0)); then
  explicit=0
  variants=(generic avx2 avx_vnni avx512_vnni neon_dot neon)
fi
failed=0
for v in "${variants[@]}"; do
  reason="$(why_not "$v")"
  if [[ -n "$reason" ]]; then
    if ((explicit)); then echo "int_dot $v: cannot run here: $reason" >&2; failed=1
    else echo "int_dot $v: skipped: $reason"; fi
    continue
  fi
  echo "== $v"
  if ! build_and_run "$v"; then echo "int_dot $v: FAILED" >&2; failed=1; fi
done
exit "$failed"
