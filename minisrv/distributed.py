"""Tensor parallelism's process group: which rank this process is, and the collectives the model's layers call.

Every rank runs the same forward on its shard of the weights; the layers combine the shards with `all_reduce`
(after the row-parallel o and down projections, and the vocabulary-split embedding) and `all_gather_last` (the
vocabulary-split logits). Tensors travel over `group` (NCCL on CUDA, gloo on the CPU); the step messages rank 0
sends the others travel through a shared-memory block (step_channel.py), and through `control`, a gloo group, as
pickled objects where that block is missing or a message does not fit it.

A model built with `TensorParallel.single()` calls no collective at all: one GPU pays nothing for this.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch

from minisrv.step_channel import ShmBroadcast, dumps

logger = logging.getLogger("minisrv")

# NVLink multicast (NVLS) stays off in every process: NCCL, torch's symmetric memory and NVSHMEM would otherwise
# use it on hosts that have it, and multicast objects can take a shared host's GPUs out of service
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# a collective that waits this long for a peer has lost it (a rank that dies is also noticed by its exit)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# with --enable-one-shot-all-reduce, all-reduces of at most this many bytes (decode steps: batch x hidden x 2) take
# the one-shot path on CUDA (off by default: on 2 H200s it measured no faster than NCCL, see the README)
ONE_SHOT_MAX_BYTES = 1 << 20
# with --enable-flashinfer-allreduce-fusion, batches of at most this many tokens (decode) all-reduce, add the
# residual and normalise in one kernel (its buffers: about 4 x 2 x this x hidden x 2 bytes a rank)
FUSED_NORM_MAX_TOKENS = 512


class Rendezvous(NamedTuple):
    """Where a tensor-parallel group meets (rank 0's tcp:// address), and the number its process groups' names
    start at.

    Why the number: torch names process groups by a per-process counter that restarts at 0 when the groups are
    destroyed, and torch's symmetric memory (the fused all-reduce's and the one-shot all-reduce's buffers) keeps
    what it set up per group name for the life of the process. A second engine in the same process (an offline
    script, a test) would reuse the first one's names, and its symmetric-memory rendezvous would wait forever on
    the first group's state. So rank 0 never lets the counter go back (`_teardown`) and hands its value to the
    ranks it spawns (fresh processes): every rank names its groups alike, and never twice."""

    address: str
    first_group: int


def new_rendezvous(address: str) -> Rendezvous:
    """Rank 0's: the address and this process's next process-group number."""
    return Rendezvous(address, _group_counter() or 0)


class SymmetricMemoryUse:
    """Whether this process has joined a symmetric-memory rendezvous (the one-shot or the fused all-reduce's
    buffers), which only the first tensor-parallel engine of a process may do.

    Why it is kept per process: torch numbers the store exchanges of its symmetric-memory rendezvous with one
    counter per process that never goes back (the sequence number of CUDASymmetricMemory's StoreExchange), and the
    store keys the ranks meet on carry that number. Ranks 1.. are new processes for every engine and count from 0;
    rank 0 of a second engine in the same process would count on from the first engine's, and each side would wait
    for keys the other never writes (2 x H200: the second fused engine's set-up hung). torch keeps that counter
    where it cannot be read or reset, so this records the one fact that predicts it."""

    joined = False


def _group_counter() -> Optional[int]:
    """torch.distributed's next process-group number in this process (None where torch keeps no such counter)."""
    from torch.distributed import distributed_c10d as c10d
    return getattr(getattr(c10d, "_world", None), "group_count", None)


def _set_group_counter(value: int) -> None:
    from torch.distributed import distributed_c10d as c10d
    if _group_counter() is not None:
        c10d._world.group_count = value


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank is gone, or ranks ran different steps): no step can run."""


class OneShotAllReduce:
    """A small all-reduce in one kernel through torch's symmetric memory (NVLink peer-to-peer loads, no multicast):
    each rank copies its part into a buffer every rank can read, then every rank sums all the parts itself.

    Why: a decode step all-reduces twice a layer, a few KiB to a MiB each time. NCCL's ring takes several
    kernel-to-kernel hops over the link for that; one-shot takes one barrier and one read of each peer's buffer.
    The kernel's barriers on entry and exit make reusing the one buffer safe. Larger messages (prefill) stay with
    NCCL, whose bandwidth wins there. Measured on 2 H200s in CUDA graphs, NCCL's low-latency protocol was as fast
    (8.3 vs 8.4 us at 8 KiB, 16.2 vs 16.6 us at 1 MiB; scripts/bench_allreduce.py), so this is opt-in
    (`--enable-one-shot-all-reduce`), kept for hosts where NCCL's small messages are slower."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer[:x.numel()]
        if self.fused_copy:  # the copy into the shared buffer happens inside the kernel
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x.view(-1), "sum", self.group_name)
        else:
            buf.copy_(x.view(-1))
            out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)
        return out.view(x.shape)


class FusedAllReduceNorm:
    """All-reduce, residual add and RMSNorm in one kernel: FlashInfer's port of TensorRT-LLM's all-reduce fusion,
    over buffers in torch's symmetric memory (peer-to-peer over NVLink; its multicast backend is never asked for).

    Why: a decode step all-reduces after every o and down projection and then adds the residual and normalises;
    on 2 H200s (Llama-3-8B shape, batch 1) NCCL's all-reduce took 6.8 us and the fused add + norm 2.5 us, 64 times
    a step, against a step of ~4 ms. One kernel reads each rank's partial sums from its peers directly (one-shot
    for small batches) and writes both the normalised output and the new residual. Batches of more than
    `max_tokens` rows (prefill chunks) keep NCCL and the separate norm."""

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
        """Let go of the peer buffers. FlashInfer keeps every workspace's symmetric-memory buffers referenced until
        told (trtllm_ar's workspace registry): without this each engine closed in a process would leave its
        buffers, registered under its process group, behind. Every rank calls it, with no kernel of its own in
        flight, before the group is torn down (destroy_tensor_parallel)."""
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
        norm_out = torch.empty_like(x)
        residual_out = torch.empty_like(residual)
        self.comm.allreduce_fusion(input=x, workspace=self.workspace, pattern=self.pattern,
                                   residual_out=residual_out, norm_out=norm_out, residual_in=residual,
                                   rms_gamma=weight, rms_eps=eps)
        return norm_out, residual_out


@dataclass
class TensorParallel:
    rank: int
    size: int
    group: Any = None  # torch.distributed group for tensors (None when size is 1)
    control: Any = None  # gloo group: start-up agreements, step messages `channel` cannot carry (None: size 1)
    one_shot: Optional[OneShotAllReduce] = None  # small all-reduces on CUDA (None: NCCL for every size)
    channel: Optional[ShmBroadcast] = None  # step messages (None: over `control` only)
    fused_norm: Optional[FusedAllReduceNorm] = None  # all-reduce + add + RMSNorm in one kernel (None: separate)
    health_check: Optional[Callable[[], None]] = None  # rank 0: raises if a rank is gone (set by the engine)

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls(0, 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks: in place (NCCL, gloo), or a new tensor (one-shot). Use the result."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank r's part at columns [r*n, (r+1)*n)."""
        if self.size == 1:
            return x
        import torch.distributed as dist
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
            import torch.distributed as dist
            dist.broadcast(x, src=0, group=self.group)
        return x

    def send_object(self, obj: Any) -> None:
        """Rank 0: one picklable object to every other rank (through the shared-memory channel, or over the gloo
        control group when it is missing or the object does not fit it)."""
        if self.channel is not None and self.channel.write(dumps(obj), self.health_check):
            return
        import torch.distributed as dist
        dist.broadcast_object_list([obj], src=0, group=self.control)

    def recv_object(self) -> Any:
        """Ranks > 0: the next object rank 0 sends."""
        if self.channel is not None:
            payload = self.channel.read()
            if payload is not None:
                return pickle.loads(payload)
        import torch.distributed as dist
        box: List[Optional[Any]] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV pool size each rank's memory allows)."""
        if self.size == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def init_tensor_parallel(rank: int, size: int, rendezvous: Rendezvous, device: torch.device,
                         one_shot_dtype: Optional[torch.dtype] = None,
                         fused_norm: Optional[Tuple[int, torch.dtype]] = None) -> TensorParallel:
    """Join the group of `size` ranks that meet at `rendezvous` (rank 0's, see Rendezvous). On CUDA with
    `one_shot_dtype` (the model's), small all-reduces of that dtype take the one-shot path (OneShotAllReduce);
    with `fused_norm` (the model's hidden size and dtype), decode batches all-reduce, add and normalise in one
    kernel (FusedAllReduceNorm); a rank that cannot set it up makes every rank raise."""
    if size == 1:
        return TensorParallel.single()
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    import torch.distributed as dist
    if dist.is_initialized():  # left by an engine whose group broke (a lost rank): it is never used again
        logger.warning("dropping a broken tensor-parallel group left by an earlier engine")
        _teardown(30.0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    _set_group_counter(rendezvous.first_group)
    dist.init_process_group(backend, init_method=rendezvous.address, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    control = dist.new_group(list(range(size)), backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    tp = TensorParallel(rank, size, dist.group.WORLD, control)
    tp.all_reduce(torch.zeros(1, device=device))  # NCCL sets up its communicator here, not inside a graph capture
    tp.channel = _open_step_channel(tp)
    wants_symmetric_memory = device.type == "cuda" and (fused_norm is not None or one_shot_dtype is not None)
    # every rank but rank 0 is a new process: rank 0's record decides (see SymmetricMemoryUse)
    symmetric_memory_free = wants_symmetric_memory and bool(tp.min_over_ranks(int(not SymmetricMemoryUse.joined)))
    if symmetric_memory_free:
        SymmetricMemoryUse.joined = True  # from the first exchange on, whether or not the set-up succeeds
    if device.type == "cuda" and fused_norm is not None:
        if not symmetric_memory_free:
            raise RuntimeError("--enable-flashinfer-allreduce-fusion: an earlier tensor-parallel engine of this "
                               "process set up torch's symmetric memory, which torch allows once a process (its "
                               "rendezvous would wait forever); start this engine in a new process, or leave the "
                               "fusion off on one of them")
        tp.fused_norm = _open_fused_norm(tp, device, *fused_norm)
    if device.type == "cuda" and one_shot_dtype is not None:
        one_shot = None
        if not symmetric_memory_free:
            logger.warning("one-shot all-reduce unavailable: an earlier tensor-parallel engine of this process set "
                           "up torch's symmetric memory, which torch allows once a process; NCCL does every "
                           "all-reduce")
        else:
            try:
                one_shot = OneShotAllReduce(tp.group, device, one_shot_dtype, ONE_SHOT_MAX_BYTES)
            except Exception as e:  # noqa: BLE001 - no peer access, or a torch without symmetric memory
                logger.warning("one-shot all-reduce unavailable (%s: %s); NCCL does every all-reduce",
                               type(e).__name__, e)
        # every rank must take the same path for the same message: agree on it
        tp.one_shot = one_shot if tp.min_over_ranks(int(one_shot is not None)) else None
        if tp.one_shot is not None:
            tp.one_shot(torch.zeros(8, dtype=one_shot_dtype, device=device))  # set up outside any graph capture
            torch.cuda.synchronize(device)
    return tp


def _open_fused_norm(tp: TensorParallel, device: torch.device, hidden: int, dtype: torch.dtype
                     ) -> FusedAllReduceNorm:
    """The fused all-reduce + norm on every rank, or an error on every rank (a rank where it fails says why)."""
    fused = None
    try:
        fused = FusedAllReduceNorm(tp.rank, tp.size, tp.group, FUSED_NORM_MAX_TOKENS, hidden, dtype)
    except Exception as e:  # noqa: BLE001 - no FlashInfer comm module, no peer access
        logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s)", type(e).__name__, e)
    if not tp.min_over_ranks(int(fused is not None)):
        raise RuntimeError("--enable-flashinfer-allreduce-fusion: FlashInfer's fused all-reduce could not be set up "
                           "on every rank (see the warning above); without the flag NCCL does the all-reduces")
    torch.cuda.synchronize(device)
    return fused


def _open_step_channel(tp: TensorParallel) -> Optional[ShmBroadcast]:
    """The shared-memory block for step messages (every rank opens it, or none does: then gloo carries them)."""
    import torch.distributed as dist
    rank, size = tp.rank, tp.size
    channel = None
    box: List[Optional[str]] = [None]
    try:
        if rank == 0:
            channel = ShmBroadcast.create(size - 1)
            box[0] = channel.name
    except Exception as e:  # noqa: BLE001 - e.g. no /dev/shm
        logger.warning("no shared memory for step messages (%s: %s); they go over gloo", type(e).__name__, e)
    dist.broadcast_object_list(box, src=0, group=tp.control)
    if rank > 0 and box[0] is not None:
        try:
            channel = ShmBroadcast.attach(box[0], size - 1, rank - 1)
        except Exception as e:  # noqa: BLE001
            logger.warning("rank %d cannot open the step channel (%s: %s); step messages go over gloo",
                           rank, type(e).__name__, e)
    everyone = tp.min_over_ranks(int(channel is not None))  # now every rank has attached, or failed
    if rank == 0 and channel is not None:
        channel.unlink()  # mapped by every rank: the name is no longer needed, and nothing can leak
    if not everyone:
        if channel is not None:
            channel.close()
        return None
    return channel


def destroy_tensor_parallel(tp: TensorParallel, timeout_s: float = 30.0) -> None:
    """Drop the process groups so that another engine in this process can form its own. Every rank calls it at
    the same time (rank 0 right after telling the others to stop): NCCL's teardown waits for the peers' teardown.

    It runs in a thread given `timeout_s`: a teardown that cannot finish (a peer gone) is logged, never hung on."""
    if tp.size > 1:
        if tp.channel is not None:
            tp.channel.close()
            tp.channel = None
        if tp.fused_norm is not None or tp.one_shot is not None:  # their buffers, before the group they belong to
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no kernel of this rank still reads or writes them
            if tp.fused_norm is not None:
                tp.fused_norm.close()
            tp.fused_norm = tp.one_shot = None
        _teardown(timeout_s)


def _teardown(timeout_s: float) -> None:
    import torch.distributed as dist

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
