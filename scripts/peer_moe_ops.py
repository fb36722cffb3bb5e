"""Measurement stand-ins for the two sgl-kernel ops mini-SGLang's MoE layer calls (`topk_softmax`,
`moe_align_block_size`), for running mini-SGLang on the MoE checkpoint beside minisrv (`scripts/gpu_bench.sh
offline` appends this file to the peers' `sgl_kernel` shim): the sgl-kernel wheel (about 535 MB) cannot reach the
GPU machine. Torch ops with sgl-kernel's outputs for expert ids in range and no host sync, so mini-SGLang's CUDA
graphs capture them; a few more small kernels a layer than sgl-kernel's, so its figure is a lower bound."""
# measurement stand-ins for the two sgl-kernel MoE ops mini-SGLang calls (the sgl-kernel wheel cannot travel):
# torch ops, no host sync (CUDA graphs capture them); same outputs as sgl-kernel's for expert ids in range
import torch as _torch


def topk_softmax(topk_weights, topk_ids, gating_output, renormalize=False):
    w, i = _torch.topk(_torch.softmax(gating_output.float(), dim=-1), topk_weights.shape[1], dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    topk_weights.copy_(w)
    topk_ids.copy_(i.to(topk_ids.dtype))


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad,
                         cumsum_buffer, pad_sorted_token_ids=True):
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    counts = _torch.zeros(num_experts, dtype=_torch.long, device=dev).scatter_add_(0, flat, _torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = _torch.cumsum(padded, 0)
    starts = ends - padded
    order = _torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = _torch.cumsum(counts, 0) - counts
    rank = _torch.arange(n, device=dev) - first[expert_of]
    sorted_token_ids.fill_(n)
    sorted_token_ids.scatter_(0, starts[expert_of] + rank, order.to(sorted_token_ids.dtype))
    blocks = _torch.arange(expert_ids.numel(), device=dev) * block_size
    expert_ids.copy_(_torch.searchsorted(ends, blocks, right=True).clamp_(max=num_experts - 1).to(expert_ids.dtype))
    num_tokens_post_pad.copy_(ends[-1:].to(num_tokens_post_pad.dtype))
    cumsum_buffer[:1].zero_()
    cumsum_buffer[1:num_experts + 1].copy_(ends.to(cumsum_buffer.dtype))
