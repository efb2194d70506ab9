"""GGUF files: checked, converted into a conversion-cache entry, and read block by block.

A conversion stores once the tensors no run quantises (`aici-base.safetensors`) and
leaves the GGUF's matrices where they are; a mode's first load reads its matrices from
there as the GGUF's own codes and scales (Q4_0, Q4_1, Q8_0 exactly; K-quants on the
int4/int8 kernels), so a quantised model never makes a dense copy. Converting the default
model takes ~2 s once; a later load reads ~0.3 s of headers.

Modules (* imports torch):

    convert.py *         checking a GGUF and converting it (config, tokenizer, tensors)
    tensors.py *         the tensors stored once; the matrices left in the GGUF
    matrices.py *        those matrices read from the GGUF when a mode builds its layers
    blocks.py            Q4_0/Q4_1/Q8_0 blocks as integer codes and scales (numpy)
    kquant.py            K-quant and Q5_0 matrices as int4/int8 codes and scales (numpy)
    block_embedding.py * an input embedding kept as blocks, rows dequantised as looked up
    identity.py          a GGUF's content digest: the conversion cache's key
    entry_record.py      an entry's file names and its record of the GGUF it came from
"""
