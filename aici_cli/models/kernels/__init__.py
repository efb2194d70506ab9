"""The CPU kernels the project builds itself, the one reading of this machine's CPU every
kernel choice uses, and the probe that tries a mode's kernels before a run trusts them.

`cpu_features.py` reads the CPU once per process (a lower instruction set can be forced:
`AICI_BATCH_ISA`); `int_mm.py` picks the best variant of the int8/int4 kernels this CPU
runs, builds it with the torch operators (`int_mm.cpp`) into the cache at first use
(~6 s) and registers them with PyTorch, so eager passes, torch.compile graphs and
AOTInductor packages call them alike. `probe.py` keeps one verdict per machine, mode,
shapes and kernel source; the child that runs a mode's layers lives above the layers it
tries (`checks/`).

The arithmetic is native/, plain C without torch, as llama.cpp's CPU backend keeps it: a
generic reference (generic.c, which also quantises the activations) beside one file per
instruction set (x86_avx512_vnni.c, x86_avx_vnni.c, x86_avx2.c, arm_neon.c with and
without the dot product: each only its two tile kernels, tiles.h walks the tiles and the
rows for all; x86_quantise.c quantises the activations with AVX2 for every x86 variant,
the generic quantiser's bytes), all declared in int_dot.h, which states the layout and
the order of every float operation: every variant's outputs are the generic one's, bit
for bit. A new instruction set is a new file there and a row of `int_mm.X86_VARIANTS` or
`int_mm.ARM_VARIANTS`, not a branch in a caller. Built into the same library with each
variant's flags: rows_attention.c (rows_attention.h), the eager passes' attention of
one-token rows over each row's own cache slots (`aici::rows_attention`), float32,
against a float64 model rather than bit for bit. build_and_test.sh builds and runs
both files' C tests for every variant this machine can run, ARM under qemu-aarch64.

Modules (* imports torch):

    cpu_features.py  the CPU's flags, model and torch's capability, read once
    int_mm.py *      the int kernels' variants: choose, build, load, use, reference
    int_mm.cpp       the torch operators over native/: checks, output, threads
    native_build.py  a native library compiled into the cache, found once a process
    rows_attention.py * one-token rows' attention over their own slots, where it applies
    native_norm.py *  a decoder's RMSNorm as one opaque call: the compiled step's norms
    probe.py         the kernel probe's verdicts, cached per machine; runs the child
    aligned.py *     every weight a kernel reads at a 64-byte boundary
    huge_pages.py *  the weights a step streams read onto 2 MiB pages, where the kernel lends them
"""
