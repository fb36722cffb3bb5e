"""EAGLE-3 speculative decoding on the CPU: outputs identical to the same run without it (greedy and seeded
sampling, through the prefix cache, chunked prefill and stops), the engine's drafts equal to a dense reference (the
head's causal forward over HF's hidden states of the same checkpoint), and clear errors at start for a head that
does not exist or does not fit the target."""
from __future__ import annotations

import json
import os

import pytest
import torch

from minisrv import SamplingParams
from minisrv.config import EngineConfig
from minisrv.models.eagle3 import load_eagle3_head

from .helpers import EngineWatch, greedy, make_llm, make_prompts, vocab_of
from .helpers.eagle_heads import save_eagle3_head


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("qwen3")  # 3 layers: the head reads the inputs of layers 0, 1 and 2


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return save_eagle3_head(str(tmp_path_factory.mktemp("eagle3-head")), target, seed=3, draft_vocab=200)


def eagle(head, steps=3, **kw):
    return dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=steps,
                speculative_disable_by_batch_size=8, **kw)


def generate(path, prompts, params, **kw):
    llm = make_llm(path, **kw)
    watch = EngineWatch(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    watch.assert_idle()
    return outs, llm.engine.stats(), llm


@pytest.mark.parametrize("params", [greedy(40), SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40,
                                                               ignore_eos=True, logprobs=2)],
                         ids=["greedy", "seeded"])
def test_outputs_as_without_speculation(target, head, params):
    prompts = make_prompts(vocab_of(target))[:4]
    plain, _, _ = generate(target, prompts, params)
    spec, stats, _ = generate(target, prompts, params, **eagle(head))
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        if params.logprobs:
            assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)


def test_prefix_cache_chunked_prefill_and_stops(target, head):
    """A shared prompt served from the prefix cache, a long prompt in chunks, a stop id and max_tokens that fall
    inside drafted runs: the same outputs as without speculation."""
    vocab = vocab_of(target)
    base = make_prompts(vocab, [60], seed=5)[0]
    prompts = [base, base[:50] + [7, 8, 9], make_prompts(vocab, [20], seed=6)[0]]
    kw = dict(disable_radix_cache=False, chunked_prefill_size=16)
    plain, _, _ = generate(target, prompts, greedy(23), **kw)
    spec, stats, _ = generate(target, prompts, greedy(23), **kw, **eagle(head, steps=4))
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    stop = plain[0].token_ids[9]
    p = SamplingParams(temperature=0.0, max_tokens=23, stop_token_ids=[stop])
    plain, _, _ = generate(target, prompts, p, **kw)
    spec, _, _ = generate(target, prompts, p, **kw, **eagle(head, steps=4))
    assert [(o.token_ids, o.finish_reason) for o in plain] == [(o.token_ids, o.finish_reason) for o in spec]


def test_drafts_equal_a_dense_reference(target, head):
    """After a prompt's prefill the engine's drafts are the head's chain computed densely: entries 0..P-1 from HF's
    hidden states (inputs of the layers read) and the next tokens' embeddings, then each draft fed back with the
    head's own output, every entry attending causally to those before it."""
    from transformers import AutoModelForCausalLM
    prompt = make_prompts(vocab_of(target), [17], seed=9)[0]
    llm = make_llm(target, **eagle(head, steps=3))
    eng = llm.engine
    req = eng.add_request(prompt, greedy(2))
    while not req.output_ids:
        eng.step()
    drafts = eng.drafter.propose(req.rid, req.all_ids, 3)
    assert drafts is not None and len(drafts) == 3
    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    ids = req.all_ids  # the prompt and its first token
    with torch.no_grad():
        hs = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    h = load_eagle3_head(head, 256, torch.float32, torch.device("cpu"))
    read = h.config.layers_read(hf.config.num_hidden_layers)
    aux = torch.cat([hs[i][0] for i in read], dim=-1)  # [P, 3 x hidden]
    embed = hf.get_input_embeddings()
    embeds, hidden = embed(torch.tensor(ids[1:])), h.fc(aux)
    expected = []
    with torch.no_grad():
        for _ in range(3):
            out = h.forward_dense(embeds, hidden, torch.arange(len(embeds)))
            tok = int(h.to_target_ids(h.logits(out[-1:]).argmax(-1)))
            expected.append(tok)
            embeds = torch.cat([embeds, embed(torch.tensor([tok]))])
            hidden = torch.cat([hidden, out[-1:]])
    assert drafts == expected


def test_errors_at_start(target, head, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        make_llm(target, **eagle(str(tmp_path / "missing")))
    wide = save_eagle3_head(str(tmp_path / "wide"), target, target_hidden_size=96)
    with pytest.raises(ValueError, match="hidden states of size 96"):
        make_llm(target, **eagle(wide))
    other = save_eagle3_head(str(tmp_path / "other"), target, vocab_size=vocab_of(target) + 64)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(target, **eagle(other))
    broken = str(tmp_path / "broken")
    save_eagle3_head(broken, target)
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(broken, "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, os.path.join(broken, "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        make_llm(target, **eagle(broken))
    for ids in ([-1, 0], [0, 1, 3], [1, 0, 2]):  # two layers read, a layer past the target's 3, out of order
        odd = save_eagle3_head(str(tmp_path / f"reads{len(ids)}{ids[-1]}"), target,
                               eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        with pytest.raises(ValueError, match="distinct layers in increasing order among the target's 3"):
            make_llm(target, **eagle(odd))
    with open(os.path.join(head, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
    for bad, why in [(dict(speculative_algorithm="EAGLE3"), "EAGLE3 needs"),
                     (dict(speculative_algorithm="NGRAM", speculative_draft_model_path=head), "EAGLE3's head"),
                     (dict(speculative_algorithm="NGRAM", speculative_num_steps=3), "chain"),
                     (dict(tp_size=2, **eagle(head)), "one rank")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig(**bad)
    assert EngineConfig(**eagle(head, steps=6)).speculative_num_draft_tokens == 7
