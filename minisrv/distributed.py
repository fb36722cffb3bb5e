"""Tensor parallelism's process group: which rank this process is, and the collectives the model's layers call.

Every rank runs the same forward on its shard of the weights; the layers combine the shards with `all_reduce`
(after the row-parallel o and down projections, and the vocabulary-split embedding) and `all_gather_last` (the
vocabulary-split logits). Tensors travel over `group` (NCCL on CUDA, gloo on the CPU); the step messages rank 0
sends the others travel over `control`, a gloo group, as pickled objects.

A model built with `TensorParallel.single()` calls no collective at all: one GPU pays nothing for this.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger("minisrv")

# NVLink multicast (NVLS) stays off in every process: NCCL, torch's symmetric memory and NVSHMEM would otherwise
# use it on hosts that have it, and multicast objects can take a shared host's GPUs out of service
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# how long a rank waits for rank 0's next step message: without end (an idle server sends none for hours); a rank
# that dies is noticed by its exit, a node that vanishes by its heartbeats (engine/node_watch.py)
IDLE_WAIT = datetime.timedelta(days=365)
# with --enable-flashinfer-allreduce-fusion, batches of at most this many tokens (decode) all-reduce, add the
# residual and normalise in one kernel (its buffers: about 4 x 2 x this x hidden x 2 bytes a rank)
FUSED_NORM_MAX_TOKENS = 512


class Rendezvous(NamedTuple):
    """Where a tensor-parallel group meets (rank 0's tcp:// address), the number its process groups' names start
    at, and the seconds every rank has to join (also the longest a collective waits for a peer).

    Why the number: torch names process groups by a per-process counter that restarts at 0 when the groups are
    destroyed, and torch's symmetric memory keeps what it set up per group name for the life of the process: a
    second engine in the same process would reuse the first one's names and wait forever on the first group's
    state. So rank 0 never lets the counter go back (`drop_process_group`) and hands its value to the ranks it
    spawns."""

    address: str
    first_group: int
    timeout_s: float = 600.0


def new_rendezvous(address: str, timeout_s: float) -> Rendezvous:
    return Rendezvous(address, _group_counter() or 0, timeout_s)


class SymmetricMemoryUse:
    """Whether this process has joined a symmetric-memory rendezvous (the fused all-reduce's buffers), which only the
    first tensor-parallel engine of a process may do.

    Why: torch numbers the store exchanges of that rendezvous with a per-process counter that never goes back and
    cannot be read or reset. Ranks 1.. are new processes for every engine and count from 0; rank 0 of a second
    engine in the same process would count on from the first engine's, and each side would wait for keys the other
    never writes. So this records the one fact that predicts the counter."""

    joined = False


def _group_counter() -> Optional[int]:
    """torch.distributed's next process-group number in this process (None where torch keeps no such counter)."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "group_count", None)


def _set_group_counter(value: int) -> None:
    if _group_counter() is not None:
        dist.distributed_c10d._world.group_count = value


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank is gone, or ranks ran different steps): no step can run."""


class FusedAllReduceNorm:
    """All-reduce, residual add and RMSNorm in one kernel: FlashInfer's port of TensorRT-LLM's all-reduce fusion,
    over buffers in torch's symmetric memory (peer-to-peer over NVLink; its multicast backend is never asked for).

    Why: a decode step all-reduces after every o and down projection and then adds the residual and normalises, a
    few microseconds each, twice a layer (docs/tensor-parallel.md has the figures). One kernel reads each rank's
    partial sums from its peers directly and writes both the normalised output and the new residual. Batches of
    more than `max_tokens` rows (prefill chunks) keep NCCL and the separate norm."""

    def __init__(self, tp_rank: int, tp_size: int, group: Any, max_tokens: int, hidden: int,
                 dtype: torch.dtype) -> None:
        import flashinfer.comm as comm
        self.comm = comm
        self.max_tokens, self.hidden, self.dtype = max_tokens, hidden, dtype
        self.workspace = comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=tp_size, rank=tp_rank, max_token_num=max_tokens, hidden_dim=hidden,
            dtype=dtype, group=group)
        self.pattern = comm.AllReduceFusionPattern.kARResidualRMSNorm

    def close(self) -> None:
        """Let go of the peer buffers, which FlashInfer keeps referenced until told (trtllm_ar's workspace registry).
        Every rank calls it, with no kernel of its own in flight, before the group is torn down."""
        workspace, self.workspace = self.workspace, None
        if workspace is None:
            return
        from flashinfer.comm.trtllm_ar import trtllm_destroy_ipc_workspace_for_all_reduce_fusion as release
        release(workspace.ipc_handles)
        workspace.destroy()

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and 0 < x.shape[0] <= self.max_tokens and x.shape[1] == self.hidden
                and x.dtype == self.dtype and x.is_contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual)."""
        norm_out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        self.comm.allreduce_fusion(input=x, workspace=self.workspace, pattern=self.pattern,
                                   residual_out=residual_out, norm_out=norm_out, residual_in=residual,
                                   rms_gamma=weight, rms_eps=eps)
        return norm_out, residual_out


@dataclass
class TensorParallel:
    rank: int
    size: int
    group: Any = None  # torch.distributed group for tensors (None when size is 1)
    control: Any = None  # gloo group: start-up agreements and rank 0's step messages (None: size 1)
    fused_norm: Optional[FusedAllReduceNorm] = None  # all-reduce + add + RMSNorm in one kernel (None: separate)

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls(0, 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (NCCL, gloo)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embed_rows(self, ids: torch.Tensor, start: int, rows: int,
                   lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The embedding of ids from a table split by vocabulary rows: lookup(local ids) reads this rank's rows
        [start, start + rows); ids outside them contribute zeros, and the all-reduce sums each token's one row."""
        if not self.enabled:
            return lookup(ids)
        local = ids - start
        outside = (local < 0) | (local >= rows)
        out = lookup(local.masked_fill(outside, 0))
        return self.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank r's part at columns [r*n, (r+1)*n)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x to every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def send_object(self, obj: Any) -> None:
        """Rank 0: one picklable object to every other rank, over the gloo control group."""
        dist.broadcast_object_list([obj], src=0, group=self.control)

    def recv_object(self) -> Any:
        """Ranks > 0: the next object rank 0 sends."""
        box: List[Optional[Any]] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV pool size each rank's memory allows)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def init_tensor_parallel(rank: int, size: int, rendezvous: Rendezvous, device: torch.device,
                         fused_norm: Optional[Tuple[int, torch.dtype]] = None) -> TensorParallel:
    """Join the group of `size` ranks that meet at `rendezvous`. On CUDA with `fused_norm` (the model's hidden size
    and dtype), decode batches all-reduce, add and normalise in one kernel; a rank that cannot set it up makes every
    rank raise."""
    if size == 1:
        return TensorParallel.single()
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    if dist.is_initialized():  # left by an engine whose group broke (a lost rank): it is never used again
        logger.warning("dropping a broken tensor-parallel group left by an earlier engine")
        drop_process_group(30.0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    _set_group_counter(rendezvous.first_group)
    try:
        dist.init_process_group(backend, init_method=rendezvous.address, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=rendezvous.timeout_s), **kwargs)
    except RuntimeError as e:  # torch's DistStoreError, DistNetworkError: a rank (a node) that never came
        raise TensorParallelError(
            f"the {size} tensor-parallel ranks did not all join at {rendezvous.address} within "
            f"{rendezvous.timeout_s:.0f} s ({str(e).strip()}); start every node with the same --tp-size, --nnodes "
            f"and --dist-init-addr") from e
    control = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_WAIT)
    tp = TensorParallel(rank, size, dist.group.WORLD, control)
    tp.all_reduce(torch.zeros(1, device=device))  # NCCL sets up its communicator here, not inside a graph capture
    if device.type == "cuda" and fused_norm is not None:
        # every rank but rank 0 is a new process: rank 0's record decides (see SymmetricMemoryUse)
        if not tp.min_over_ranks(int(not SymmetricMemoryUse.joined)):
            raise RuntimeError("--enable-flashinfer-allreduce-fusion: an earlier tensor-parallel engine of this "
                               "process set up torch's symmetric memory, which torch allows once a process (its "
                               "rendezvous would wait forever); start this engine in a new process, or leave the "
                               "fusion off on one of them")
        SymmetricMemoryUse.joined = True  # from the first exchange on, whether or not the set-up succeeds
        fused = None  # on every rank, or an error on every rank (a rank where it fails says why)
        if rank == 0:  # (never a silent wait: FlashInfer compiles its communication module on first use)
            logger.info("setting up FlashInfer's fused all-reduce + RMSNorm (its communication module compiles on "
                        "first use: minutes)")
        t0 = time.perf_counter()
        try:
            fused = FusedAllReduceNorm(rank, size, tp.group, FUSED_NORM_MAX_TOKENS, *fused_norm)
        except Exception as e:  # noqa: BLE001 - no FlashInfer comm module, no peer access
            logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s)", type(e).__name__, e)
        if rank == 0 and fused is not None:
            logger.info("fused all-reduce + RMSNorm ready in %.1f s", time.perf_counter() - t0)
        if not tp.min_over_ranks(int(fused is not None)):
            raise RuntimeError("--enable-flashinfer-allreduce-fusion: FlashInfer's fused all-reduce could not be set "
                               "up on every rank (see the warning above); without the flag NCCL does the all-reduces")
        torch.cuda.synchronize(device)
        tp.fused_norm = fused
    return tp


def destroy_tensor_parallel(tp: TensorParallel, timeout_s: float = 30.0) -> None:
    """Drop the process groups so that another engine in this process can form its own. Every rank calls it at
    the same time (rank 0 right after telling the others to stop): NCCL's teardown waits for the peers' teardown.

    It runs in a thread given `timeout_s`: a teardown that cannot finish (a peer gone) is logged, never hung on."""
    if tp.size > 1:
        if tp.fused_norm is not None:  # its buffers, before the group they belong to
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no kernel of this rank still reads or writes them
            tp.fused_norm.close()
            tp.fused_norm = None
        drop_process_group(timeout_s)


def drop_process_group(timeout_s: float) -> None:
    """This process's side of the group, dropped (where one is left) in a thread given `timeout_s`."""
    def teardown() -> None:
        if dist.is_initialized():
            count = _group_counter()
            dist.destroy_process_group()
            if count is not None:  # the next engine's groups get fresh names (see Rendezvous); max: a teardown
                # that timed out and finishes late must not take the counter back below a newer engine's groups
                _set_group_counter(max(count, _group_counter() or 0))

    worker = threading.Thread(target=teardown, name="minisrv-tp-teardown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("tensor-parallel process group did not tear down within %.0f s", timeout_s)
