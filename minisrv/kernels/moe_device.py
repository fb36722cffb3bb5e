"""The Triton code of a MoE layer's routing and alignment: the kernels of moe_route.py and moe_align.py and the device
functions they share. Imported only by those modules' launcher factories (so that importing minisrv does not import
Triton), and kept at module level because Triton resolves the device functions a kernel calls through the kernel's
module globals (its interpreter, which the CPU tests use, through nothing else)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_table(counts, sorted_ptr, expert_ids_ptr, num_padded_ptr, n_pairs, n_blocks, pid, n_programs,
                BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr):
    """From the pairs per expert (counts [EXPERTS]): the block table, the programs taking turns over its blocks, and
    (program 0) the padded total and every group's padding. Returns each group's first slot."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    # each block's expert: the number of groups that end at or before the block's first row
    for b0 in range(pid * BLOCKS, n_blocks, n_programs * BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        first = blocks * BLOCK_M
        e = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(first < total, e, -1), mask=blocks < n_blocks)
    if pid == 0:
        tl.store(num_padded_ptr, total)
        # each group's padding: the slots after its pairs, up to its padded end
        pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + pad, tl.zeros_like(pad) + n_pairs, mask=pad < ends[:, None])
    return starts


@triton.jit
def count_pairs(ids, ok, EXPERTS: tl.constexpr):
    """The pairs per expert among the lanes where ok (the others read expert 0 and are taken off its count:
    histogram's mask is Triton 3.4+)."""
    experts = tl.arange(0, EXPERTS)
    return tl.histogram(tl.where(ok, ids, 0), EXPERTS) - tl.where(experts == 0, tl.sum((~ok).to(tl.int32), 0), 0)


@triton.jit
def align_pieces(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, n_pairs, n_blocks, pid, n_programs,
                 BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr, BLOCKS: tl.constexpr,
                 PIECE: tl.constexpr):
    """Program pid of n_programs, placing pairs [pid * PIECE, +PIECE): it counts every pair per expert and those
    ahead of its piece, then places each of its pairs at its group's start, after the pairs of its expert ahead of
    the piece and those ahead within the piece (a PIECE x PIECE comparison): index order within a group."""
    experts = tl.arange(0, EXPERTS)
    piece_lo = pid * PIECE
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    before = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, n_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=0).to(tl.int32)
        counts += count_pairs(ids, offs < n_pairs, EXPERTS)
        before += count_pairs(ids, offs < piece_lo, EXPERTS)
    starts = block_table(counts, sorted_ptr, expert_ids_ptr, num_padded_ptr, n_pairs, n_blocks, pid, n_programs,
                         BLOCK_M, BLOCKS)
    lanes = tl.arange(0, PIECE)
    offs = piece_lo + lanes
    ok = offs < n_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
    base = tl.sum(tl.where(ids[:, None] == experts[None, :], (starts + before)[None, :], 0), axis=1)
    ahead = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    tl.store(sorted_ptr + base + tl.sum(ahead.to(tl.int32), axis=1), offs, mask=ok)


@triton.jit
def moe_align(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr, n_pairs, num_experts,
              n_blocks, PHASE: tl.constexpr, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
              BLOCKS: tl.constexpr, PIECE: tl.constexpr):
    """PHASE 0: one launch, each program placing one PIECE of the pairs. The three launches of large steps, each
    program one CHUNK of pairs: 1, count them into counts (zeroed); 2 (one program), the block table from the
    counts; 3, place them through atomic cursors. EXPERTS: num_experts rounded up to a power of two."""
    experts = tl.arange(0, EXPERTS)
    pid = tl.program_id(0)
    if PHASE == 0:
        align_pieces(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, n_pairs, n_blocks, pid,
                     tl.num_programs(0), BLOCK_M, EXPERTS, CHUNK, BLOCKS, PIECE)
    if PHASE == 1:
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=0).to(tl.int32)
        tl.atomic_add(counts_ptr + experts, count_pairs(ids, offs < n_pairs, EXPERTS), mask=experts < num_experts)
    if PHASE == 2:  # the block table, and the placement launch's cursors: each group's first slot
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        starts = block_table(counts, sorted_ptr, expert_ids_ptr, num_padded_ptr, n_pairs, n_blocks, 0, 1, BLOCK_M,
                             BLOCKS)
        tl.store(cursor_ptr + experts, starts, mask=experts < num_experts)
    if PHASE == 3:  # each pair to the next free slot of its group
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        ok = offs < n_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
        tl.store(sorted_ptr + slot, offs, mask=ok)


@triton.jit
def top_k_rows(x, rows, row_ok, num_experts, weights_ptr, ids_ptr, TOP_K: tl.constexpr,
               RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, EXPERTS: tl.constexpr, K_POW2: tl.constexpr):
    """Logits x float32 [rows, EXPERTS] (-inf past num_experts) -> each row's k largest (ties to the lowest expert
    index) written as weights and ids [n, TOP_K]: renormalised, the softmax of the k logits (equal to softmax ->
    top-k -> divide by the sum); otherwise the softmax over all experts at the k."""
    experts = tl.arange(0, EXPERTS)
    x = tl.where(x == x, x, float("-inf"))  # a NaN logit is never chosen over a number, and never matches best
    top = tl.max(x, axis=1)
    slots = tl.arange(0, K_POW2)
    chosen = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    exps = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    if RENORMALIZE:
        denom = tl.zeros((BLOCK_T,), dtype=tl.float32)
    else:
        denom = tl.sum(tl.exp(x - top[:, None]), axis=1)
    for j in tl.static_range(TOP_K):
        best = tl.max(x, axis=1)
        # ties to the lowest index; kept in range even for a row of -inf (then expert 0 is repeated)
        index = tl.minimum(tl.min(tl.where(x == best[:, None], experts[None, :], EXPERTS), axis=1), num_experts - 1)
        e = tl.exp(best - top)
        if RENORMALIZE:
            denom += e
        chosen = tl.where(slots[None, :] == j, index[:, None], chosen)
        exps = tl.where(slots[None, :] == j, e[:, None], exps)
        x = tl.where(experts[None, :] == index[:, None], float("-inf"), x)
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    ok = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, exps / denom[:, None], mask=ok)
    tl.store(ids_ptr + out, chosen, mask=ok)


@triton.jit
def moe_route_topk(logits_ptr, weights_ptr, ids_ptr, n_tokens, num_experts, stride_t, TOP_K: tl.constexpr,
                   RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, EXPERTS: tl.constexpr, K_POW2: tl.constexpr):
    """Program pid routes tokens [pid * BLOCK_T, +BLOCK_T) from their logits [n_tokens, num_experts]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS)
    row_ok = rows < n_tokens
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + experts[None, :],
                mask=row_ok[:, None] & (experts < num_experts)[None, :], other=float("-inf")).to(tl.float32)
    top_k_rows(x, rows, row_ok, num_experts, weights_ptr, ids_ptr, TOP_K, RENORMALIZE, BLOCK_T, EXPERTS, K_POW2)


@triton.jit
def moe_router(x_ptr, w_ptr, bias_ptr, partial_ptr, counter_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ids_ptr,
               num_padded_ptr, n_tokens, hidden, num_experts, stride_x, n_blocks, k_piece,
               HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, EXPERTS: tl.constexpr,
               K_POW2: tl.constexpr, K_PIECES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr,
               PAIRS: tl.constexpr):
    """The router of up to BLOCK_T tokens in one launch. Program pid: experts [(pid // K_PIECES) * BLOCK_E,
    +BLOCK_E) over the K piece pid % K_PIECES of x [n_tokens, hidden] @ w [num_experts, hidden]^T, its float32
    partial logits written to partial [K_PIECES, BLOCK_T, EXPERTS]; then a ticket from the arrival counter. The
    program that arrives last sums the partials in piece order (the same logits every run), adds the bias (HAS_BIAS:
    bias [num_experts]), rounds them to the router's dtype (the logits the model's own product gives), writes the
    top-k weights and ids, aligns the pairs (as moe_align's one launch, in one program) and resets the counter for
    the next call."""
    pid = tl.program_id(0)
    piece = pid % K_PIECES
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < n_tokens
    es = (pid // K_PIECES) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = piece * k_piece + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + es.to(tl.int64)[:, None] * hidden + ks[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, k_piece, BLOCK_K):
        k_ok = ks + k0 < hidden
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(es < num_experts)[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(partial_ptr + (piece * BLOCK_T + rows[:, None]) * EXPERTS + es[None, :], acc)
    tl.debug_barrier()  # every thread's partials are written before the ticket releases them
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        experts = tl.arange(0, EXPERTS)
        logits = tl.zeros((BLOCK_T, EXPERTS), dtype=tl.float32)
        for p in tl.static_range(K_PIECES):  # past L1: other programs wrote them
            logits += tl.load(partial_ptr + (p * BLOCK_T + rows[:, None]) * EXPERTS + experts[None, :],
                              cache_modifier=".cg")
        if HAS_BIAS:
            logits += tl.load(bias_ptr + experts, mask=experts < num_experts, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            logits = logits.to(tl.bfloat16).to(tl.float32)
        else:
            logits = logits.to(tl.float16).to(tl.float32)
        logits = tl.where((experts < num_experts)[None, :], logits, float("-inf"))
        top_k_rows(logits, rows, row_ok, num_experts, weights_ptr, ids_ptr, TOP_K, RENORMALIZE, BLOCK_T, EXPERTS,
                   K_POW2)
        tl.debug_barrier()  # the ids are written before the alignment reads them
        align_pieces(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, n_tokens * TOP_K, n_blocks, 0, 1, BLOCK_M,
                     EXPERTS, PAIRS, BLOCKS, PAIRS)
        tl.store(counter_ptr, 0)
