"""A GGUF file's tokenizer as transformers converts it, without transformers' GGUF reader (whose module imports
torch: seconds on a first start, in the HTTP process that otherwise never needs it).

The tokenizer's metadata is read from the places gguf_file.read_gguf found, in the form transformers' reader gives
it, and transformers' own converter and tokenizer class build the tokenizer from it, so the result is transformers'
conversion itself (tests/test_gguf_tokenizer.py checks it on gpt2 and llama vocabularies)."""
from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Tuple

from gguf import GGUFReader
from gguf.constants import GGUFValueType

# the struct format of each scalar type, as transformers' reader unpacks them
_SCALAR = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
           GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
           GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
           GGUFValueType.FLOAT64: "d"}


def _string(data: memoryview, pos: int) -> Tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, pos)
    pos += 8
    return bytes(data[pos:pos + length]).decode("utf-8"), pos + length


def _value(data: memoryview, pos: int, kind: int) -> Any:
    """The value of type `kind` at `pos`: a number, bool, string, or a list of them (arrays of arrays: None)."""
    if kind in _SCALAR:
        return struct.unpack_from("<" + _SCALAR[kind], data, pos)[0]
    if kind == GGUFValueType.STRING:
        return _string(data, pos)[0]
    if kind != GGUFValueType.ARRAY:
        return None
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item in _SCALAR:
        return list(struct.unpack_from(f"<{count}{_SCALAR[item]}", data, pos))
    if item != GGUFValueType.STRING:
        return None
    values: List[str] = []
    for _ in range(count):
        value, pos = _string(data, pos)
        values.append(value)
    return values


def tokenizer_metadata(reader: GGUFReader) -> Optional[Dict[str, Any]]:
    """The file's `general.architecture` and every `tokenizer.*` value, arrays read in full; None for a file not in
    little-endian order (transformers' reader reads only those)."""
    if reader.byte_order != "I":
        return None
    data = memoryview(reader.data)
    out: Dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not (name.startswith("tokenizer.") or name == "general.architecture") or not field.types:
            continue
        value_at = field.offset + 8 + len(name.encode("utf-8")) + 4  # key length, key, value type
        out[name] = _value(data, value_at, field.types[0])
    return out


def gguf_tokenizer_inputs(metadata: Dict[str, Any]) -> Tuple[str, Dict[str, Any], Dict[str, Any]]:
    """transformers' `get_gguf_tokenizer(path)` for this metadata: (architecture, tokenizer dict, tokenizer config),
    its key names taken from transformers' own table."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS

    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return metadata["general.architecture"], tokenizer, config


def build_gguf_tokenizer(cls: Any, reader: GGUFReader, folder: str) -> Optional[Any]:
    """`cls.from_pretrained(folder, gguf_file=...)` for the file `reader` read, built from its metadata as read
    here; None where this transformers has no such converter or the file is not one this reader handles (the
    caller converts it the slow way)."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    except ImportError:
        return None
    # (the names gguf_tokenizer_inputs takes too: a transformers without them converts the slow way)
    if not all(hasattr(mapping, n) for n in ("_SPECIAL_TOKENS", "GGUF_TOKENIZER_MAPPING", "convert_gguf_tokenizer")):
        return None
    metadata = tokenizer_metadata(reader)
    if metadata is None or "general.architecture" not in metadata or "tokenizer.ggml.tokens" not in metadata:
        return None
    architecture, tokenizer_dict, config = gguf_tokenizer_inputs(metadata)
    backend, extra = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    return cls.from_pretrained(folder, tokenizer_object=backend, **config, **extra)
