"""A ~1B random-weight Llama as a Q4_0 GGUF, built locally, and its bandwidth limit.

The model has TinyLlama-1.1B's shape (hidden 2048, 22 layers, intermediate 5632, 32
heads, 4 key/value heads, RoPE base 10000, RMS eps 1e-5) and the default model's
tokenizer and vocabulary (its GGUF's `tokenizer.*` fields, copied), so this project and
llama.cpp tokenize the same and the comparison needs no download. Weights are normal *
0.02 from a fixed seed (norms 1), laid out as llama.cpp's converter writes a Llama (q/k
rows interleaved for its RoPE) and typed as `llama-quantize ... Q4_0` types them: the
matrices and the token embedding Q4_0, output.weight Q6_K, norms F32. gguf-py has no Q6_K
quantiser: the Q6_K blocks are written here (per-16 absmax scales, not llama.cpp's
search for the best ones, but valid blocks). Built once, cached under --out-dir.

It then measures read bandwidth with --threads threads (torch: the sum of a large
float32 tensor, best of several) and prints the bytes read per generated token (every
tensor at its GGUF size except the token embedding, which is only looked up) and the
limit they set: bandwidth / bytes per token.

    python bench/big_llama.py                      # build (cached), print path + limit
    python bench/big_llama.py --bench              # and run bench/llama_cpp.py on it

With --bench it first builds this project's compiled step for the model
(`aici-batch prepare`, outside every timing) so that the `--compile auto`
rows measure what a second run gets, then runs the one-stream rows and the plain batch-8
rows of bench/llama_cpp.py, and prints the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS = 2048, 22, 5632, 32, 4
ROPE_THETA, RMS_EPS, CONTEXT = 10000.0, 1e-5, 2048
SEED, SCALE = 1234, 0.02
FILE_NAME = "big-llama-1.1b.Q4_0.gguf"


def default_gguf() -> Path:
    from aici_cli.models.sources.packaged import default_gguf_path

    return Path(default_gguf_path())


def tensor_specs(vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, cols] or [n], type) in llama.cpp's order."""
    head_dim = HIDDEN // HEADS
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (vocab, HIDDEN), "Q4_0")]
    for i in range(LAYERS):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (HIDDEN,), "F32"),
                  (b + "attn_q.weight", (HIDDEN, HIDDEN), "Q4_0"),
                  (b + "attn_k.weight", (KV_HEADS * head_dim, HIDDEN), "Q4_0"),
                  (b + "attn_v.weight", (KV_HEADS * head_dim, HIDDEN), "Q4_0"),
                  (b + "attn_output.weight", (HIDDEN, HIDDEN), "Q4_0"),
                  (b + "ffn_norm.weight", (HIDDEN,), "F32"),
                  (b + "ffn_gate.weight", (FFN, HIDDEN), "Q4_0"),
                  (b + "ffn_up.weight", (FFN, HIDDEN), "Q4_0"),
                  (b + "ffn_down.weight", (HIDDEN, FFN), "Q4_0")]
    specs += [("output_norm.weight", (HIDDEN,), "F32"),
              ("output.weight", (vocab, HIDDEN), "Q6_K")]
    return specs


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaving of q/k rows for its RoPE (its loader undoes it)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def make_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...],
                kind: str) -> np.ndarray:
    """One tensor as the file stores it: F32 norms, quantised blocks otherwise."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= SCALE
    if name.endswith("attn_q.weight"):
        w = permute(w, HEADS)
    elif name.endswith("attn_k.weight"):
        w = permute(w, KV_HEADS)
    if kind == "Q6_K":
        return quantize_q6_k(w)
    return quantize(np.ascontiguousarray(w), GGMLQuantizationType[kind])


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """[N, K] float (K a multiple of 256) as Q6_K blocks, [N, K/256 * 210] uint8, laid
    out as `gguf.quants` dequantises them: per 16 values an absmax scale in 8 bits of
    the super-block's f16 one. Done in row chunks to bound the temporaries."""
    n = weight.shape[0]
    return np.concatenate([_q6_k_rows(weight[i:i + 4096]) for i in range(0, n, 4096)])


def _q6_k_rows(weight: np.ndarray) -> np.ndarray:
    n = weight.shape[0]
    w = weight.astype(np.float32).reshape(-1, 256)
    step = np.abs(w.reshape(-1, 16, 16)).max(-1) / 31  # [B, 16]
    d = (step.max(-1, keepdims=True) / 127).astype(np.float16)  # [B, 1]
    d32 = np.where(d == 0, 1, d.astype(np.float32))
    sc = np.clip(np.round(step / d32), 1, 127).astype(np.int8)
    unit = np.repeat(d32 * sc, 16, axis=1)
    q = (np.clip(np.round(w / unit), -32, 31) + 32).astype(np.uint8)  # [B, 256]
    halves = q.reshape(-1, 2, 4, 32)  # [B, half of 128, quarter, 32]
    ql = (halves[:, :, 0:2] & 0x0F) | ((halves[:, :, 2:4] & 0x0F) << 4)
    hi = halves >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.view(np.uint8), d.view(np.uint8)], axis=1).reshape(n, -1)


def copy_tokenizer(writer: Any, source: Path) -> int:
    """Every `tokenizer.*` field of `source` into `writer`; returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    return vocab


def write_metadata(writer: Any, vocab: int) -> None:
    writer.add_name("big-llama-1.1b-random")
    writer.add_file_type(2)  # LLAMA_FTYPE_MOSTLY_Q4_0
    writer.add_vocab_size(vocab)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_quantization_version(2)


def build(out_dir: Path) -> tuple[Path, float]:
    """The GGUF under `out_dir` (built if missing, written to a temporary name first);
    returns its path and the build's seconds (0 when cached)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = out_dir / FILE_NAME
    if path.is_file():
        return path, 0.0
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    partial = path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), "llama")
    vocab = copy_tokenizer(writer, default_gguf())
    write_metadata(writer, vocab)
    rng = np.random.default_rng(SEED)
    for name, shape, kind in tensor_specs(vocab):
        data = make_tensor(rng, name, shape, kind)
        if kind == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path, time.perf_counter() - started


def bytes_per_token(path: Path) -> tuple[int, int]:
    """(bytes read per generated token, file size): every tensor at its GGUF size but
    the token embedding (one row of it is looked up per token)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    total = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")
    return total, path.stat().st_size


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 10) -> float:
    """Bytes per second that `threads` threads read: a float32 tensor of `mib` MiB
    summed, best of `repeats` (after one untimed pass)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return x.numel() * 4 / best


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def prepare(path: Path, threads: int) -> float:
    """`aici-batch prepare` of the model: its conversion and its compiled step for 1 row
    (the one-stream rows) and 8 (the batch rows), which the `--compile auto` rows then
    start with, as a user's runs after `prepare` do. Returns its seconds."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aici_cli", "prepare", "-q", "--model", str(path),
                    "--device", "cpu"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - started


def run_bench(path: Path, args: argparse.Namespace) -> None:
    """bench/llama_cpp.py's one-stream and plain batch-8 rows on the built model."""
    print(f"warm-up: aici-batch prepare (builds the packaged steps, untimed): "
          f"{prepare(path, args.threads):.0f} s", flush=True)
    print(f"load average before: {load_average()}", flush=True)
    cmd = [sys.executable, str(REPO / "bench" / "llama_cpp.py"), "--gguf", str(path),
           "--only", "stream,batch", "--stream-tokens", str(args.tokens),
           "--max-tokens", str(args.tokens), "--quantize", "auto", "--compile", "auto,off",
           "--drafts", "0", "--rounds", str(args.rounds), "--threads", str(args.threads),
           "--out", str(args.out_dir / "llama_cpp.json")]
    if args.llama_server:
        cmd += ["--llama-server", args.llama_server]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    print(f"load average after: {load_average()}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=REPO / "out" / "big_llama")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", action="store_true",
                    help="then run bench/llama_cpp.py's stream and batch rows on it")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-server", default=None, help="llama-server binary")
    args = ap.parse_args()
    path, build_s = build(args.out_dir)
    per_token, size = bytes_per_token(path)
    bandwidth = read_bandwidth(args.threads)
    built = f"built in {build_s:.0f} s" if build_s else "cached"
    print(f"gguf: {path} ({size / 2**20:.0f} MiB, {built})")
    print(f"bytes read per token: {per_token / 2**20:.1f} MiB "
          "(every tensor at its GGUF size but the token embedding)")
    print(f"read bandwidth ({args.threads} threads): {bandwidth / 1e9:.2f} GB/s")
    print(f"bandwidth limit: {bandwidth / per_token:.1f} tok/s", flush=True)
    if args.bench:
        run_bench(path, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
