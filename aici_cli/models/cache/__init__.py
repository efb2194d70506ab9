"""The conversion cache: aici-batch's folder of converted models, each entry's files per
mode, the layouts kept so a later run does not pack again, and pruning.

An entry is keyed by its GGUF's content (`gguf/identity.py`), made by one process while
the others wait (`core/file_lock.py`), and grows by one file per mode first used (packed
int4/int8 layers, the VNNI tiles); `aici-batch models --prune` removes what nothing uses.

Modules (* imports torch):

    conversions.py     the cache's folder and the GGUF conversions in it
    entries.py         its entries, their sizes, unused ones, pruning
    entry_files.py     the files an entry gains per mode; which prune removes
    machine.py         the CPU the cache was made on; another's machine-bound parts removed
    packed_layers.py * quantised layers kept in their kernels' layout
"""
