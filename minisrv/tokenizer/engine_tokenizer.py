"""The engine's tokenizer: the Rust tokenizer (`tokenizers`) read from tokenizer.json for what the engine does with
every request (streaming decode, the eos id), transformers' tokenizer loaded on first use for anything else
(grammars, offline chat templates, encoding). Why: importing transformers and building its tokenizer costs about a
third of a CPU restart.

Only for folders whose tokenizer_config.json names transformers' plain fast tokenizer class (what a GGUF file's
tokenizer becomes; model-specific classes may change the Rust tokenizer as they load) and its eos token; anything
else gets transformers' tokenizer at once."""
from __future__ import annotations

import importlib.metadata
import json
import os
import threading
from typing import Any, Callable, Optional

FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class EngineTokenizer:
    """A transformers tokenizer as far as any caller can tell: `backend_tokenizer`, `eos_token_id` and
`clean_up_tokenization_spaces` from the folder's files, everything else from `load_hf()`'s, built on first use."""

    def __init__(self, backend: Any, eos_token_id: Optional[int], clean_up_tokenization_spaces: bool,
                 load_hf: Callable[[], Any]) -> None:
        self.backend_tokenizer = backend
        self.eos_token_id = eos_token_id
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._load_hf = load_hf
        self._hf: Any = None
        self._lock = threading.Lock()

    @property
    def hf(self) -> Any:
        """transformers' tokenizer of the same folder (loaded on first use)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    self._hf = self._load_hf()
        return self._hf

    @property
    def hf_loaded(self) -> bool:
        return self._hf is not None

    def __getattr__(self, name: str) -> Any:  # only for names not set above
        if name.startswith("__") or name in ("_hf", "_load_hf", "_lock"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.hf)

    def __deepcopy__(self, memo: dict) -> Any:
        """A deep copy is a copy of transformers' tokenizer (the lock and loader are not copied)."""
        import copy
        return copy.deepcopy(self.hf, memo)


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or a dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _clean_up_default() -> Optional[bool]:
    """transformers' default for clean_up_tokenization_spaces when a config does not set it: False from version 5
    on; None (ask transformers' tokenizer) before, where it depended on the class."""
    try:
        major = int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    return False if major >= 5 else None


def _same_added_tokens(configured: dict, backend: Any) -> bool:
    """Whether the config's added tokens are the Rust tokenizer's, with the same special flag (transformers adds or
    re-flags them when it loads, which changes what skip_special_tokens drops)."""
    have = backend.get_added_tokens_decoder()
    for key, token in configured.items():
        added = have.get(int(key))
        if added is None or added.content != _token_text(token) or \
                bool(added.special) != bool(token.get("special", False) if isinstance(token, dict) else False):
            return False
    return True


def engine_tokenizer_from_folder(folder: str, load_hf: Callable[[], Any]) -> Optional[EngineTokenizer]:
    """The engine's tokenizer of a saved fast tokenizer folder, or None where this folder needs transformers'
    own loading (another class, no tokenizer.json, no eos token in its config, an unreadable file)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
        if config.get("tokenizer_class") not in FAST_TOKENIZER_CLASSES:
            return None
        if any(config.get(k) for k in ("add_bos_token", "add_eos_token", "add_prefix_space")):
            return None  # transformers rewrites the Rust tokenizer's pre-tokenizer or post-processor for these
        eos_text = _token_text(config.get("eos_token"))
        clean_up = config.get("clean_up_tokenization_spaces", _clean_up_default())
        if eos_text is None or clean_up is None:
            return None
        from tokenizers import Tokenizer
        backend = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        if not _same_added_tokens(config.get("added_tokens_decoder") or {}, backend):
            return None
    except Exception:  # noqa: BLE001 - any failure (unreadable, not JSON, a bad tokenizer.json): transformers decides
        return None
    eos = backend.token_to_id(eos_text)
    if eos is None:
        return None
    return EngineTokenizer(backend, eos, bool(clean_up), load_hf)


def transformers_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer itself, for code that checks its type (xgrammar's TokenizerInfo)."""
    return tokenizer.hf if isinstance(tokenizer, EngineTokenizer) else tokenizer
