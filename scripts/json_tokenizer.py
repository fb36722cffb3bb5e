"""A tokenizer for a random-weight checkpoint that JSON can be written with: ids 0-94 are the printable ASCII
characters, the rest words "w<id>" (the checkpoint maker's word-level tokenizer has no "{" or '"', so under a JSON
grammar no token would be allowed). Used by the structured-output benchmarks (scripts/gpu_bench.sh).

  python scripts/json_tokenizer.py OUT_DIR CHECKPOINT_DIR
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def json_tokenizer(vocab_size: int, eos_id: int) -> PreTrainedTokenizerFast:
    chars = [chr(c) for c in range(32, 127)]
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab.update({f"w{i}": i for i in range(len(chars), vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w95"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one character a token
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"w{eos_id}", unk_token="w95")


def main() -> None:
    out, ckpt = sys.argv[1], sys.argv[2]
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    json_tokenizer(cfg["vocab_size"], eos).save_pretrained(out)
    print("saved", out, cfg["vocab_size"], "tokens")


if __name__ == "__main__":
    main()
