"""The decode loop: batching, per-row KV cache, masks, sampling."""
