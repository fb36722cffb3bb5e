#!/usr/bin/env python
"""A random-weight GGUF file of the Llama-3-8B shape in llama.cpp's Q4_K_M mix, for benchmarks: every matrix Q4_K
except output.weight, and attn_v and ffn_down in the layers llama.cpp widens (its use_more_bits: the first and
last eighth of the layers and every third between), which are Q6_K; norms float32. Block bytes are drawn at random
with their float16 scales set to small values (the values are noise, the bytes' layout and the arithmetic the
kernels do are a real file's), written with numpy in seconds; a byte-level BPE vocabulary of the shape's size (the
256 byte symbols, then filler tokens; Llama 3's special tokens at its ids) goes in the file, so the server starts on
it alone.

  python scripts/make_gguf_checkpoint.py OUT.gguf [--layers 32 --hidden 4096 --inter 14336 --vocab 128256]
  python scripts/make_gguf_checkpoint.py OUT.gguf --resident   # load it on the GPU: resident bytes vs the file's
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HALF_AT = {"Q4_K": (0, 2), "Q6_K": (208,)}  # the float16 d (and dmin) of each block
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes] of random blocks of `kind`, their float16 scales about 1e-3 (dmin smaller)."""
    size = BLOCK_BYTES[kind]
    b = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for j, at in enumerate(HALF_AT[kind]):
        h = (rng.random(len(b), dtype=np.float32) * (2e-3 if j == 0 else 5e-4)).astype(np.float16)
        b[:, at:at + 2] = h.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def add_tokenizer(w, vocab: int) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = sorted(set(bytes_to_unicode().values()))
    special = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>"}
    g = "\u0120"  # the byte alphabet's space
    tokens = alphabet + [g + "w", g + "t"] + [special.get(i, f"<w{i}>") for i in range(len(alphabet) + 2, vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(vocab)])
    # two merges at least: a reader that unwraps one-element arrays (transformers' GGUF reader) would get a string
    w.add_token_merges([g + " w", g + " t"])
    w.add_bos_token_id(min(128000, vocab - 2))
    w.add_eos_token_id(min(128001, vocab - 1))


def write(path: str, layers: int, hidden: int, inter: int, vocab: int, heads: int = 32, kv_heads: int = 8) -> int:
    """Writes the file; returns its tensors' bytes."""
    from gguf import GGUFWriter
    from gguf.constants import GGMLQuantizationType as Q
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    add_tokenizer(w, vocab)
    head_dim, total = hidden // heads, 0

    def matrix(name: str, kind: str, rows: int, cols: int) -> None:
        nonlocal total
        raw = random_blocks(rng, kind, rows, cols)
        total += raw.nbytes
        w.add_tensor(name, raw, raw_dtype=Q[kind])

    def norm(name: str) -> None:
        nonlocal total
        total += hidden * 4
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))

    matrix("token_embd.weight", "Q4_K", vocab, hidden)
    norm("output_norm.weight")
    matrix("output.weight", "Q6_K", vocab, hidden)
    for i in range(layers):
        wide = "Q6_K" if use_more_bits(i, layers) else "Q4_K"
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", "Q4_K", heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", "Q4_K", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", wide, kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", "Q4_K", hidden, heads * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", "Q4_K", inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", "Q4_K", inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", wide, hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def resident(path: str) -> None:
    """Loads the file on this machine's GPU and prints the model's resident weight bytes against the file's."""
    from gguf import GGUFReader

    from minisrv.llm import LLM
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    llm = LLM(model=path, dtype="bfloat16", cache_dir="off", max_total_tokens=4096, disable_cuda_graph=True,
              log_level="warning")
    try:
        held = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    finally:
        llm.close()
    print(f"resident weights {held / 2**30:.3f} GiB against the file's tensors {file_bytes / 2**30:.3f} GiB: "
          f"{held / file_bytes:.3f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the .gguf file to write (or, with --resident, to load)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--resident", action="store_true", help="load OUT on the GPU and print its resident bytes")
    a = p.parse_args()
    if a.resident:
        resident(a.out)
        return 0
    t = time.perf_counter()
    total = write(a.out, a.layers, a.hidden, a.inter, a.vocab)
    print(f"wrote {a.out}: tensors {total / 2**30:.3f} GiB in {time.perf_counter() - t:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
