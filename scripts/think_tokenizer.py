"""The random-weight checkpoint's word-level tokenizer with two of its words renamed `<think>` and `</think>` (single,
non-special tokens, as in Qwen3's and DeepSeek-R1's vocabularies), so that a server on that checkpoint can run a
reasoning parser. Used by the reasoning parser's serving benchmark (scripts/gpu_bench.sh serving).

  python scripts/think_tokenizer.py OUT_DIR CHECKPOINT_DIR
"""
import json
import os
import shutil
import sys


def main() -> None:
    out, ckpt = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(ckpt, name)):
            shutil.copy(os.path.join(ckpt, name), out)
    with open(os.path.join(ckpt, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    size = len(vocab)
    for word, new in ((f"w{size - 10}", "<think>"), (f"w{size - 9}", "</think>")):
        vocab[new] = vocab.pop(word)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    print("saved", out, "with <think> and </think>")


if __name__ == "__main__":
    main()
