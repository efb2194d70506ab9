"""What checks this machine's kernels with the model's own layers: the kernel probe's child
process and `aici-batch doctor`'s report.

It sits above the layers it tries (`quant/`): `kernels/probe.py` keeps the verdicts and
starts the child by module name. A mode's probe costs a few seconds once per machine,
shapes and kernel source; a crash, hang or wrong answer there costs the run nothing.

Modules (all but cache_key.py import torch):

    probe_child.py  one mode's layers built as a run builds them, timed and checked
    doctor.py       the machine, each mode's verdict, and what auto picks
    cache_key.py    the key a CI job keeps the cache folder under
"""
