"""A GGUF file (llama.cpp's format) as (HF name, dequantised tensor) pairs, its header checked first.

gguf's GGUFReader, with every header read bounds-checked against the file's size and every tensor's bytes checked
before any is touched, so a truncated or damaged file is a WeightLoadError that says where it is cut (GGUFReader
alone fails with an IndexError, or loops on a damaged array length). Metadata array values (the vocabulary) are
skipped, not read: walking them element by element is nearly all of GGUFReader's time for the default model."""
from __future__ import annotations

import math
import os
import re
import struct
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .checkpoint import Unreadable, WeightLoadError, check_tensor_spans, damaged
from minisrv.models.args import ModelArgs

MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions
MAX_NESTING = 8  # arrays of arrays: deeper than this is garbage, not a model


class _CheckedReader(GGUFReader):
    """GGUFReader with its own steps hooked (`_get`, `_get_field_parts`, `_get_tensor_info_field`, `_build_tensors`;
tests/test_loader.py compares its table with GGUFReader's). `spans`: (tensor name, first byte, end byte) of every
tensor at absolute file offsets."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.path.getsize(path)
        self.spans: List[Tuple[str, int, int]] = []
        self._infos_read = 0
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":  # also an empty file, which numpy cannot map
            raise Unreadable(f"no GGUF magic: the file starts with {magic!r}")
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        # GGUFReader maps the file as a np.memmap; a plain array over the same mapping slices without making a
        # memmap object per slice, a third of the header's read
        self._mapped = mapped.view(np.ndarray)

    def _where(self) -> str:
        fields = getattr(self, "fields", None)
        if not fields or "GGUF.kv_count" not in fields:
            return "the fixed header"
        n_kv, n_tensors = (int(fields[k].parts[0][0]) for k in ("GGUF.kv_count", "GGUF.tensor_count"))
        if len(fields) - 3 < n_kv:
            return f"metadata entry {len(fields) - 2} of {n_kv}"
        return f"tensor info {self._infos_read} of {n_tensors}"

    def _past_end(self) -> Unreadable:
        return Unreadable(f"the file ends at byte {self.size}, inside {self._where()}")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if int(offset) + np.dtype(dtype).itemsize * int(count) > self.size:
            raise self._past_end()
        return super()._get(offset, dtype, count, override_order)

    def _order(self) -> str:
        host_little = sys.byteorder == "little"
        return "<" if host_little != (self.byte_order == "S") else ">"  # "S": the file's order is not the host's

    def _unpack(self, fmt: str, offset: int) -> int:
        if offset + struct.calcsize(fmt) > self.size:
            raise self._past_end()
        return struct.unpack_from(self._order() + fmt, self.data, offset)[0]

    def _skip_array(self, offset: int, depth: int) -> int:
        """Where the array at `offset` ends. Each element takes at least one byte, a string or an array at least 8:
        the walk is bounded by the file's size whatever the stored counts say."""
        item, count = self._unpack("I", offset), self._unpack("Q", offset + 4)
        offset += 12
        scalar = self.gguf_scalar_to_np.get(item)
        if scalar is not None:
            offset += count * np.dtype(scalar).itemsize
        elif item == GGUFValueType.STRING:  # a vocabulary: 10^5 strings, so the loop is kept lean
            length = struct.Struct(self._order() + "Q").unpack_from
            data, end = self.data, self.size - 8
            for _ in range(count):
                if offset > end:
                    raise self._past_end()
                offset += 8 + length(data, offset)[0]
        elif item == GGUFValueType.ARRAY:
            if depth >= MAX_NESTING:
                raise Unreadable(f"arrays nested deeper than {MAX_NESTING} (in {self._where()})")
            for _ in range(count):
                offset = self._skip_array(offset, depth + 1)
        else:
            raise Unreadable(f"unknown array element type {item} (in {self._where()})")
        if offset > self.size:
            raise self._past_end()
        return offset

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        end = self._skip_array(orig_offs, 0)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        return end - orig_offs, parts, [], [GGUFValueType.ARRAY]

    def _get_tensor_info_field(self, orig_offs: int):
        self._infos_read += 1
        return super()._get_tensor_info_field(orig_offs)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name_data, n_dims, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8")  # GGUFReader decoded it already
            if int(n_dims[0]) > MAX_DIMS:
                raise Unreadable(f"tensor {name} has {int(n_dims[0])} dimensions (at most {MAX_DIMS})")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise Unreadable(f"tensor {name} has unknown type {int(raw_type[0])}") from None
            n_elems = math.prod(int(d) for d in dims)
            if n_elems % block:
                raise Unreadable(f"tensor {name} has {n_elems} elements, not a multiple of its type's block "
                                 f"of {block}")
            begin = start_offs + int(offset[0])
            self.spans.append((name, begin, begin + n_elems // block * type_size))
        check_tensor_spans(self.path, self.spans, self.size)
        super()._build_tensors(start_offs, fields)


def read_gguf(path: str) -> GGUFReader:
    """The file's header and tensor table (tensors memory-mapped, not read), or a WeightLoadError naming the file
    and where it is truncated or damaged."""
    try:
        return _CheckedReader(path)
    except Unreadable as e:
        raise damaged(path, f"cannot read its GGUF header/tensor table ({e})") from None
    except WeightLoadError:
        raise
    except (OSError, ValueError, KeyError, IndexError, OverflowError, RecursionError, struct.error) as e:
        raise damaged(path, f"cannot read its GGUF header/tensor table ({type(e).__name__}: {e})") from e
    except Exception as e:  # noqa: BLE001 - whatever else gguf raises on a file it cannot read
        raise WeightLoadError(f"cannot read GGUF file {path}: {e}") from e


def metadata_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value: a number, a bool or a string; `...` for an array (or anything else); None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    if kind is None or kind == GGUFValueType.ARRAY:
        return ...
    value = field.parts[-1][0].item()
    return bool(value) if kind == GGUFValueType.BOOL else value


def metadata_string(reader: GGUFReader, key: str) -> Optional[str]:
    """A string value of the file's metadata (None where the key is missing or not a string)."""
    value = metadata_value(reader, key)
    return value if isinstance(value, str) else None


def has_tensor(reader: GGUFReader, name: str) -> bool:
    return any(t.name == name for t in reader.tensors)


GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}  # llama.cpp's tensor names -> HF's
LAYER_NAMES = {  # blk.<i>.<name>.weight -> model.layers.<i>.<name>.weight
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3's, fused
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
WITH_BIAS = ("attn_q", "attn_k", "attn_v")
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# a layer's experts stacked in one 3-D tensor [E, rows, cols]: read as each expert's HF tensor
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
PERMUTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")  # llama.cpp's "llama" architecture
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str) -> str:
    """The HF name of a llama.cpp tensor; "" for one not listed."""
    m = LAYER_TENSOR.match(gguf_name)
    if m is None:
        return GLOBAL_NAMES.get(gguf_name, "")
    layer, name, kind = m.groups()
    if name not in LAYER_NAMES or kind == "bias" and name not in WITH_BIAS:
        return ""
    return f"model.layers.{layer}.{LAYER_NAMES[name]}.{kind}"


def iter_gguf(path: str, args: ModelArgs, reader: Optional[GGUFReader] = None,
              blocks: bool = False) -> Iterator[Tuple[str, Any]]:
    """Dequantised tensors under HF names, one at a time. llama.cpp stores Llama's q/k rows interleaved for its
    rotary; that is undone so that our neox-style rotary (HF's) applies. `reader`: the file's read_gguf, if the
    caller has it. `blocks`: the projections, embedding and head come as their blocks (gguf_blocks.GGUFBlocks, for
    a model built with quantization "gguf" or "gguf-planes"; gguf_blocks.blocks_unavailable_in has checked their
    types)."""
    import torch

    from minisrv.models.gguf_blocks import GGUFBlocks, is_block_matrix
    from .gguf_dequant import dequantize
    reader = reader or read_gguf(path)
    permuted = args.architecture in PERMUTED
    for t in reader.tensors:
        name = hf_name(t.name)
        experts = EXPERTS.match(t.name)
        if not name and not experts:
            if t.name in ROPE_TENSORS:  # llama3's frequencies, phi3's LongRoPE factors: read into the config
                continue
            raise WeightLoadError(f"unexpected tensor {t.name!r} in {path}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        try:
            if blocks and is_block_matrix(name):
                w = GGUFBlocks(t.data, t.tensor_type, *shape)
            else:
                w = dequantize(t.data, t.tensor_type).reshape(shape)
        except Exception as e:
            raise WeightLoadError(f"cannot dequantize tensor {t.name!r} in {path}: {e}") from e
        if experts:
            layer, kind = experts.groups()
            for e in range(w.shape[0]):
                yield f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight", w[e]
            continue
        if args.architecture == "Phi3ForCausalLM" and name.endswith(".up_proj.weight"):
            name = name.replace(".up_proj.", ".gate_up_proj.")  # phi3's ffn_up holds gate then up
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args.num_heads if "q_proj" in name else args.num_kv_heads
            order = torch.arange(shape[0]).reshape(heads, shape[0] // heads // 2, 2).transpose(1, 2).reshape(-1)
            w = w.take_rows(order) if isinstance(w, GGUFBlocks) else w[order]
        yield name, w


def moe_config(reader: GGUFReader, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A GGUF MoE model's config completed from its tensor table, where transformers' GGUF config reading leaves it
    short: each expert's width (the experts' gate tensor, not a default), the dense layers (those without a router),
    and llama.cpp's Mixtral, which it writes as a "llama" with experts."""
    widths = {int(m.group(1)): int(t.shape[1]) for t in reader.tensors
              if (m := EXPERTS.match(t.name)) and m.group(2) == "gate"}
    if not widths:
        return cfg
    cfg = dict(cfg)
    arch = metadata_string(reader, "general.architecture")
    experts, used = (reader.fields.get(f"{arch}.{key}") for key in ("expert_count", "expert_used_count"))
    if experts is None or used is None:
        raise WeightLoadError(f"{reader.path}: expert tensors but no {arch}.expert_count / expert_used_count")
    mixtral = cfg.get("model_type") == "llama"
    if mixtral:
        cfg["model_type"], cfg["architectures"] = "mixtral", ["MixtralForCausalLM"]
    cfg["num_local_experts" if mixtral else "num_experts"] = int(experts.parts[-1][0])
    cfg["num_experts_per_tok"] = int(used.parts[-1][0])
    cfg["moe_intermediate_size"] = next(iter(widths.values()))
    cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if i not in widths]
    cfg["decoder_sparse_step"] = 1
    return cfg
