"""The Triton kernels of the small-batch GEMM (small_m_gemm.py launches them and says why they exist). A module of
their own because Triton resolves a kernel's helpers among module globals, and Triton is optional: small_m_gemm
imports this only when a kernel is wanted."""
import triton
import triton.language as tl


@triton.jit
def reduce_slices(acc, tile, out_ok, part_ptr, arrivals_ptr, pid, split, mn, SPLIT_K: tl.constexpr):
    """With SPLIT_K > 1: this program's float32 partial sums `acc` (offsets `tile` in the [m, n] output) go to
    part[split]; it counts itself in at its column block's arrival counter, and the last to arrive adds the
    others' partials and sets the counter back to 0 for the next product (no extra kernel to clear or reduce).
    Returns (sum, mask of what this program stores): only the last stores."""
    if SPLIT_K > 1:
        tl.store(part_ptr + split * mn + tile, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partials are written before the arrival is counted (release)
        arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel")
        tl.debug_barrier()
        # the tile's shape for the scalars (arrival order, slice number) that the masks combine
        last = (tl.zeros_like(tile) + arrived) == SPLIT_K - 1
        slice_no = tl.zeros_like(tile) + split
        for other in tl.static_range(SPLIT_K):  # the last adds the others' partials, read through L2 (.cg)
            acc += tl.load(part_ptr + other * mn + tile, mask=out_ok & last & (slice_no != other), other=0.0,
                           cache_modifier=".cg")
        tl.atomic_xchg(arrivals_ptr + pid, 0, mask=arrived == SPLIT_K - 1)
        out_ok = out_ok & last
    return acc, out_ok

@triton.jit
def kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, arrivals_ptr, m, n, k, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (pid, split) owns output columns [pid * BLOCK_N, +BLOCK_N) over K's slice number `split`, for
    all m rows (padded to BLOCK_M for the tensor-core dot)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    k_slice = k // SPLIT_K  # a multiple of BLOCK_K (checked by the launcher)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * k_slice + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * k + ks[None, :]
    w_ptrs = w_ptr + cols[:, None] * k + ks[None, :]
    row_ok = rows[:, None] < m
    col_ok = cols[:, None] < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_slice, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok, other=0.0)
        w = tl.load(w_ptrs, mask=col_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc, out_ok = reduce_slices(acc, rows[:, None] * n + cols[None, :], row_ok & (cols[None, :] < n),
                                part_ptr, arrivals_ptr, pid, split, m * n, SPLIT_K)
    if SCALED:
        acc = acc * tl.load(xs_ptr + rows, mask=rows < m, other=0.0)[:, None]
        acc = acc * tl.load(ws_ptr + cols, mask=cols < n, other=0.0)[None, :]
    tl.store(y_ptr + rows[:, None] * n + cols[None, :], acc.to(tl.bfloat16), mask=out_ok)

@triton.jit
def gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, arrivals_ptr, n, k, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALED: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr = False,
                GDC: tl.constexpr = False):
    """One row (m = 1): program (pid, split) multiplies its BLOCK_N columns' slice of W by x element-wise in
    float32 registers, BLOCK_K at a time, and sums each column's products once at the end. No tensor cores
    and no padding of the row to 16: each thread streams its share of W with wide loads.

    SILU_MUL (bf16, K not split): W is a gated MLP's gate and up projections stacked ([2n, K], gate rows first)
    and the output is silu(gate) * up over n columns; the program reads its columns' gate and up rows together.
    Each sum is rounded to bf16 before the activation, as the two products stored apart would be, so the result
    is the separate product followed by SiLU-and-mul, one kernel and one launch fewer.

    GDC (grid dependency control, SM 90+): the program lets a next kernel launched as a programmatic dependent
    launch be scheduled at once, and waits for the kernel before it (whose output x may be) to end, in case this
    one was launched so: such a kernel's launch then overlaps this one's programs instead of following them."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    k_slice = k // SPLIT_K
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * k_slice + tl.arange(0, BLOCK_K)
    col_ok = cols < n
    x_ptrs = x_ptr + ks
    w_ptrs = w_ptr + cols[:, None] * k + ks[None, :]
    up_ptrs = w_ptrs + n * k  # SILU_MUL: the up rows of the same columns
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, k_slice, BLOCK_K):
        x = tl.load(x_ptrs).to(tl.float32)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if SILU_MUL:
            up = tl.load(up_ptrs, mask=col_ok[:, None], other=0.0)
            acc_up += up.to(tl.float32) * x[None, :]
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SILU_MUL:
        gate = tl.sum(acc, axis=1).to(tl.bfloat16).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_up, axis=1).to(tl.bfloat16).to(tl.float32)
        out_ok = col_ok
    else:
        out, out_ok = reduce_slices(tl.sum(acc, axis=1), cols, col_ok, part_ptr, arrivals_ptr, pid, split, n,
                                    SPLIT_K)
        if SCALED:
            out = out * tl.load(xs_ptr) * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    tl.store(y_ptr + cols, out.to(tl.bfloat16), mask=out_ok)
