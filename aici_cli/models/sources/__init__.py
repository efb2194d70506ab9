"""Where a `--model` comes from: the short names pip packages ship, the local Hugging
Face hub cache, a model directory or a `.gguf` file, resolved to a directory offline.

Nothing here imports torch, so `aici-batch models` and the CLI's start-up stay light.

Modules:

    packaged.py     short names and the pip packages that ship them
    hub.py          the local Hugging Face hub cache
    resolve.py      a --model spec -> a model directory (converted where it is a GGUF)
    listing.py      every model --model can name (`aici-batch models`)
    model_files.py  which file of a model that failed to load is damaged
"""
