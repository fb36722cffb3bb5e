"""The Triton kernel of KVPool.store_rotated: rotary embedding of a step's q and k and the store of k and v into
the pool, in one launch instead of two (a rotary kernel, then an indexed write). A module of its own because Triton
is optional: pool.py imports this only on CUDA."""
import torch
import triton
import triton.language as tl


@triton.jit
def rope_store_kernel(q_ptr, k_ptr, v_ptr, kv_ptr, pos_ptr, loc_ptr, cos_sin_ptr, q_row, k_row, v_row, v_plane,
                      NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (t, h): token t's head h, a q head for h < NUM_Q_HEADS, else k head h - NUM_Q_HEADS. Neox rotary
    (the two halves of a head rotate together) with cos | sin of the token's position from cos_sin [P, HEAD_DIM]
    (float32), in float32, written back in place; a k head is also written, with its v head, at the token's slot
    of the layer's [2, slots, NUM_KV_HEADS, HEAD_DIM] pool (v_plane: the offset of its V half)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM // 2)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + offs)
    if h < NUM_Q_HEADS:
        src = q_ptr + t.to(tl.int64) * q_row + h * HEAD_DIM
    else:
        src = k_ptr + t.to(tl.int64) * k_row + (h - NUM_Q_HEADS) * HEAD_DIM
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + half + offs).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(src.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(src.dtype.element_ty)
    tl.store(src + offs, o1)
    tl.store(src + half + offs, o2)
    if h >= NUM_Q_HEADS:
        kh = h - NUM_Q_HEADS
        dst = kv_ptr + tl.load(loc_ptr + t).to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + kh * HEAD_DIM
        tl.store(dst + offs, o1)
        tl.store(dst + half + offs, o2)
        all_offs = tl.arange(0, HEAD_DIM)
        tl.store(dst + v_plane + all_offs, tl.load(v_ptr + t.to(tl.int64) * v_row + kh * HEAD_DIM + all_offs))


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                   loc: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """q [T, Hq, D], k and v [T, Hkv, D] (rows of any stride, heads contiguous), rotated in place; k and v written
    at slots loc [T] of kv, one layer's [2, pages, page_size, Hkv, D] pool; cos_sin [P, D] float32 at positions [T]."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    # one warp a program: a head is 64-256 elements, a few per thread (prefill launches tokens x heads programs)
    rope_store_kernel[(t, hq + hkv)](q, k, v, kv, positions, loc, cos_sin, q.stride(0), k.stride(0), v.stride(0),
                                     kv[0].numel(), NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=d, num_warps=1)
