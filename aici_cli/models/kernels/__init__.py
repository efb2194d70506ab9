"""The CPU kernels the project builds itself, the one reading of this machine's CPU every
kernel choice uses, and the probe that tries a mode's kernels before a run trusts them.

`cpu_features.py` reads the CPU once per process; `int_mm.py` builds the int8/int4
operators (`int_mm.cpp`) into the cache at first use (~6 s) and registers them with
PyTorch, so eager passes, torch.compile graphs and AOTInductor packages call them alike.
`probe.py` keeps one verdict per machine, mode, shapes and kernel source; the child that
runs a mode's layers lives above the layers it tries (`checks/`).

Modules (* imports torch):

    cpu_features.py  the CPU's flags, model and torch's capability, read once
    int_mm.py *      the int4/int8 x int8 operators: build, load, use, reference
    int_mm.cpp       their AVX512-VNNI arithmetic and PyTorch registration
    probe.py         the kernel probe's verdicts, cached per machine; runs the child
    aligned.py *     every weight a kernel reads at a 64-byte boundary
"""
