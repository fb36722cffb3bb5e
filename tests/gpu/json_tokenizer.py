"""A tokenizer for a random-weight checkpoint that JSON can be written with: ids 0-94 are the printable ASCII
characters, the rest words "w<id>" (the checkpoint maker's word-level tokenizer has no "{" or '"', so under a JSON
grammar no token would be allowed). Used by run.sh's structured-output benchmark.

  python tests/gpu/json_tokenizer.py OUT_DIR CHECKPOINT_DIR
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main() -> None:
    out, ckpt = sys.argv[1], sys.argv[2]
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    vocab_size = cfg["vocab_size"]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab.update({f"w{i}": i for i in range(len(chars), vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w95"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one character a token
    tk.decoder = decoders.Fuse()
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"w{eos}", unk_token="w95")
    fast.save_pretrained(out)
    print("saved", out, vocab_size, "tokens")


if __name__ == "__main__":
    main()
