"""Text in and out of a model without transformers: its fast tokenizer, its chat
template rendered as transformers renders it, and tools shown to it.

A run of the default model imports no transformers (~1.8 s saved); jinja2 is imported only
for runs with messages (~0.1 s).

Modules:

    fast_tokenizer.py  a plain Hugging Face fast tokenizer, read from tokenizer.json
    chat.py            rendering messages with the model's chat template
    chat_jinja.py      the template environment transformers uses, rebuilt
    tool_prompt.py     tools and past tool calls through the template, or a system message
"""
