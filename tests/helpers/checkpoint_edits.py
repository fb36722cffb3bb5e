"""Copies of a tiny checkpoint to break or edit (config fields, weight tensors), and the check that a good model
still loads and serves after a failed load."""
from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import load_file, save_file

from .engine_watch import assert_pool_free
from .hf_reference import assert_greedy_matches, hf_greedy
from .tiny_models import greedy, make_llm, make_prompts, vocab_of


def copy_model(src: str, tmp_path, name: str = "m") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def edit_config(path: str, **changes) -> None:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


def rewrite_weights(path: str, edit) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def still_serves(tiny_model) -> None:
    """After a failed load, a good checkpoint loads and generates what HF generates."""
    path = tiny_model("qwen3")
    llm = make_llm(path)
    prompt = make_prompts(vocab_of(path), [9], seed=21)[0]
    out = llm.generate(prompt, greedy(6), use_tqdm=False)[0]
    ref, scores = hf_greedy(path, prompt, 6)
    assert_greedy_matches(out.token_ids, ref, scores, "after a failed load")
    assert_pool_free(llm.engine)
