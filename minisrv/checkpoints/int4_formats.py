"""4-bit checkpoints' tensors read into the W4A16 layers' layout (models/w4a16.py, kernels/w4a16_gemm.py): each
quantised matrix's parts (packed integers, scales, zero points, group index) gathered under the name of the matrix
they stand for (`<module>.weight`), read as one `Int4Weight` of the slice a tensor-parallel rank holds.

The formats, for a matrix W [N, K] (N output channels) in groups of G along K, W = (q - zero) * scale:
- AWQ (GEMM layout): qweight int32 [K, N/8], 8 columns a word in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i,
  bits 4i, holds column 8j + order[i]); qzeros int32 [K/G, N/8] packed alike; scales float16 [K/G, N].
- GPTQ: qweight int32 [K/8, N], 8 rows of K a word in order (nibble i holds row 8j + i); qzeros int32 [K/G, N/8],
  8 columns a word in order, zero = stored + 1 in the classic format (stored as-is in gptq_v2); scales float16
  [K/G, N]; g_idx int32 [K], the group of each row (not in order: desc_act, activation order).
- compressed-tensors pack-quantized: weight_packed int32 [N, K/8] (nibble i of word j holds column 8j + i of the
  row, as signed value + 8); weight_scale [N, K/G]; weight_zero_point, asymmetric only: int32 [N/8, K/G] packed
  along N alike (or int8 [N, K/G] signed, in older files); weight_shape [2]; weight_g_idx [K] for group act order.

Activation order is undone at load: rows of K are sorted by group (so groups are contiguous again) and the layer
permutes its input columns the same way (a fused layer's parts must agree, as they do when quantised from the
same input). Rows of K are split between ranks only at group boundaries; activation order under such a split is
refused."""
from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from minisrv.kernels.w4a16_gemm import pack_rows, unpack_rows
from minisrv.models.sharding import Slice
from minisrv.models.w4a16 import Int4Scheme, Int4Weight

from .checkpoint import StoredTensor, WeightLoadError

PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]
PROJECTION = re.compile(r"(_proj|\.experts\.\d+\.w[123])\.weight$")  # (Mixtral's experts: w1, w2, w3)


def unpack_columns(words: torch.Tensor, order: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """uint8 [R, 8C] of int32 words [R, C] packed along columns: column 8j + order[i] in nibble i of word j
    (order None: column 8j + i)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] by nibble
    if order is not None:
        nibbles = nibbles[..., [order.index(c) for c in range(8)]]  # by column
    return nibbles.reshape(words.shape[0], -1).to(torch.uint8)


def int4_tensors(tensors: Iterator[Tuple[str, StoredTensor]], scheme: Int4Scheme) -> Iterator[Tuple[str, StoredTensor]]:
    """The checkpoint's tensors with each 4-bit matrix's parts read as one `<module>.weight` of shape [N, K]
    whose reader returns an Int4Weight; other tensors as they are. A projection the checkpoint left unquantised
    and a quantised lm_head, embedding or router are errors naming them (their layers are built for one kind)."""
    held = dict(tensors)  # lazy readers: nothing is read yet
    parts: Dict[str, Dict[str, StoredTensor]] = {}
    for name in list(held):
        module, _, leaf = name.rpartition(".")
        if leaf in PARTS[scheme.method]:
            parts.setdefault(module, {})[leaf] = held.pop(name)
    for name, stored in held.items():
        if PROJECTION.search(name):
            raise WeightLoadError(f"{name!r} is not quantised in this {scheme} checkpoint: minisrv serves 4-bit "
                                  "checkpoints whose projections are all 4-bit (lm_head and embedding excepted)")
        yield name, stored
    read = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}[scheme.method]
    for module, p in parts.items():
        if module.endswith(("lm_head", "embed_tokens", ".gate", "shared_expert_gate")):
            raise WeightLoadError(f"{module!r} is quantised in this checkpoint: minisrv keeps lm_head, the "
                                  "embedding and the experts' routers in 16 bits")
        try:
            shape, reader = read(p, scheme)
        except KeyError as e:
            raise WeightLoadError(f"{module!r}: no {e.args[0]} in this {scheme} checkpoint") from None
        yield f"{module}.weight", StoredTensor(shape, lambda piece, r=reader, m=module: _read(m, r, piece))


Reader = Callable[[Optional[Slice]], Int4Weight]


def _read(module: str, reader: Reader, piece: Optional[Slice]) -> Int4Weight:
    try:
        return reader(piece)
    except ValueError as e:
        raise WeightLoadError(f"{module!r}: {e}") from None


def _ranges(piece: Optional[Slice], n: int, k: int, group: int) -> Tuple[int, int, int, int]:
    """(n0, n, k0, k) of the slice `piece` of an [N, K] matrix: whole 8-column words and whole groups of K (group
    0: one group per channel, split anywhere on words of 8 rows)."""
    if piece is None:
        return 0, n, 0, k
    if piece.dim == 0:
        if piece.start % 8 or piece.length % 8:
            raise ValueError(f"output channels {piece.start}..{piece.start + piece.length} are not whole words of 8")
        return piece.start, piece.length, 0, k
    if piece.start % (group or 8) or piece.length % (group or 8):
        raise ValueError(f"input columns {piece.start}..{piece.start + piece.length} split groups of {group or 8}: "
                         "choose a tp size that splits K at group boundaries")
    return 0, n, piece.start, piece.length


def _along(dim: int, start: int, length: int, whole: int) -> Optional[Slice]:
    return None if start == 0 and length == whole else Slice(dim, start, length)


def _in_order(p: Dict[str, StoredTensor], key: str, what: str, group: int, k0: int, k: int,
              act_order: bool) -> Optional[torch.Tensor]:
    """The rows' permutation that makes groups contiguous (activation order, `what` in the config), read from the
    group index p[key]; None where the rows are in order or there is no index."""
    if key not in p:
        if act_order:
            raise ValueError(f"{what} without a {key}")
        return None
    g_idx = p[key].read(None).long()
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(g_idx.numel()) // group):
        raise ValueError(f"g_idx does not give every group {group} rows")
    if torch.equal(perm, torch.arange(g_idx.numel())):
        return None  # (desc_act with static groups: in order)
    if not act_order:
        raise ValueError("g_idx is in activation order but the config has no desc_act / actorder")
    if k0 != 0 or k != g_idx.numel():
        raise ValueError("activation-order (desc_act) weights cannot be split along K between tensor-parallel ranks")
    return perm


def _finish(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: Optional[torch.Tensor],
            scheme: Int4Scheme) -> Int4Weight:
    """Values uint8 [K, n] in checkpoint row order, scales and zeros [K/G, n]: the layer's layout."""
    if perm is not None:
        values = values[perm]
    elif scheme.act_order:
        perm = torch.arange(values.shape[0])
    return Int4Weight(pack_rows(values), scales.contiguous(), zeros.contiguous(), perm)


def _awq(p: Dict[str, StoredTensor], scheme: Int4Scheme) -> Tuple[Tuple[int, int], Reader]:
    qweight, qzeros, scales = p["qweight"], p["qzeros"], p["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = scheme.group_size or k
    _check_groups(scales.shape, (k // group, n))

    def read(piece: Optional[Slice]) -> Int4Weight:
        n0, nn, k0, kk = _ranges(piece, n, k, scheme.group_size)
        words = _along(1, n0 // 8, nn // 8, n // 8)
        grows = _along(0, k0 // group, kk // group, k // group) if scheme.group_size else None
        values = unpack_columns(qweight.read(words or _along(0, k0, kk, k)), AWQ_ORDER)
        zeros = unpack_columns(qzeros.read(words or grows), AWQ_ORDER)
        return _finish(values, scales.read(_along(1, n0, nn, n) or grows), zeros, None, scheme)
    return (n, k), read


def _gptq(p: Dict[str, StoredTensor], scheme: Int4Scheme) -> Tuple[Tuple[int, int], Reader]:
    qweight, scales = p["qweight"], p["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = scheme.group_size or k
    _check_groups(scales.shape, (k // group, n))
    if "qzeros" not in p and not scheme.symmetric:
        raise KeyError("qzeros")

    def read(piece: Optional[Slice]) -> Int4Weight:
        n0, nn, k0, kk = _ranges(piece, n, k, scheme.group_size)
        cols = _along(1, n0, nn, n)
        grows = _along(0, k0 // group, kk // group, k // group) if scheme.group_size else None
        values = unpack_rows(qweight.read(cols or _along(0, k0 // 8, kk // 8, k // 8)))
        if "qzeros" in p:
            zeros = unpack_columns(p["qzeros"].read(_along(1, n0 // 8, nn // 8, n // 8) or grows))
            zeros = zeros + 1 if scheme.zero_plus_one else zeros  # (a stored 15 reads as 16, as the format's own)
        else:
            zeros = torch.full((kk // group if scheme.group_size else 1, nn), 8, dtype=torch.uint8)
        perm = _in_order(p, "g_idx", "desc_act", group, k0, kk, scheme.act_order)
        return _finish(values, scales.read(cols or grows), zeros, perm, scheme)
    return (n, k), read


def _compressed_tensors(p: Dict[str, StoredTensor], scheme: Int4Scheme) -> Tuple[Tuple[int, int], Reader]:
    packed, scales = p["weight_packed"], p["weight_scale"]
    n, k = packed.shape[0], packed.shape[1] * 8
    group = scheme.group_size or k
    _check_groups(scales.shape, (n, k // group))
    if "weight_zero_point" not in p and not scheme.symmetric:
        raise KeyError("weight_zero_point")

    def read(piece: Optional[Slice]) -> Int4Weight:
        if "weight_shape" in p and tuple(int(d) for d in p["weight_shape"].read(None).reshape(-1)) != (n, k):
            raise ValueError(f"weight_shape {p['weight_shape'].read(None).tolist()} is not the packed [{n}, {k}]")
        n0, nn, k0, kk = _ranges(piece, n, k, scheme.group_size)
        rows = _along(0, n0, nn, n)
        gcols = _along(1, k0 // group, kk // group, k // group) if scheme.group_size else None
        words = packed.read(rows or _along(1, k0 // 8, kk // 8, k // 8))  # [n, K/8]: rows of K in order
        s = scales.read(rows or gcols).t()
        zeros = torch.full(s.shape, 8, dtype=torch.uint8)
        if not scheme.symmetric:
            zp = p["weight_zero_point"]
            if zp.shape[0] == n:  # int8, signed
                zeros = (zp.read(rows or gcols).t().to(torch.int16) + 8).to(torch.uint8)
            else:  # int32 packed along N (with the + 8)
                zeros = unpack_rows(zp.read(_along(0, n0 // 8, nn // 8, zp.shape[0]) or gcols))[:nn].t()
        perm = _in_order(p, "weight_g_idx", "group act order", group, k0, kk, scheme.act_order)
        values = unpack_rows(words.t().contiguous())
        return _finish(values, s, zeros, perm, scheme)
    return (n, k), read


def _check_groups(have: Tuple[int, ...], want: Tuple[int, int]) -> None:
    if tuple(have) != want:
        raise WeightLoadError(f"scales of shape {tuple(have)}, expected {want} for the config's group size")
