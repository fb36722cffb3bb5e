"""scripts/train_eagle3.py on a tiny random Llama: the head it saves loads with minisrv's EAGLE-3 loader as a
downloaded one would (its shape, rotary and vocabulary maps those of the target), its training lowers the held-out
loss, and its first training step is the head's dense causal forward; the training-time-test mask against one
written out by hand."""
from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from minisrv.models.eagle3 import load_eagle3_head

from .helpers.tiny_models import build_tiny_model

_spec = importlib.util.spec_from_file_location(
    "train_eagle3", Path(__file__).resolve().parent.parent / "scripts" / "train_eagle3.py")
trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trainer)


def test_ttt_mask_of_three_bases_at_step_two():
    # keys: step 0 of bases 0-2 (causal), then step 1 and step 2 of each base (its own only)
    expected = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(trainer.ttt_mask(3, 2), expected)
    assert torch.equal(trainer.ttt_mask(3, 0), expected[:, :3])


def test_expected_accepted_length_multiplies_the_steps():
    assert trainer.expected_accepted_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert trainer.expected_accepted_length([1.0, 0.0, 1.0]) == 2.0


def test_draft_vocabulary_takes_the_predicted_ids_first_then_tops_up_without_repeats():
    argmax = torch.tensor([[7, 7, 7, 5, 5, 9]])
    tokens = torch.tensor([[3, 3, 3, 7, 0, 0]])
    assert trainer.draft_vocabulary(argmax, tokens, vocab=12, size=2).tolist() == [5, 7]
    assert trainer.draft_vocabulary(argmax, tokens, vocab=12, size=5).tolist() == [0, 3, 5, 7, 9]
    assert trainer.draft_vocabulary(argmax, tokens, vocab=12, size=7).tolist() == [0, 1, 2, 3, 5, 7, 9]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target = build_tiny_model(str(tmp_path_factory.mktemp("target")), "llama", seed=3, num_hidden_layers=4)
    rng = random.Random(0)
    # a text with structure the head can learn: runs of consecutive words
    texts = []
    for _ in range(40):
        start = rng.randrange(3, 300)
        texts.append(" ".join(f"t{start + i % 7}" for i in range(rng.randint(10, 40))))
    out = str(tmp_path_factory.mktemp("head"))
    result = trainer.main(["--out", out, "--model", target, "--draft-vocab-size", "96", "--seq-len", "32",
                           "--max-tokens", "640", "--epochs", "4", "--batch", "2", "--lr", "2e-3",
                           "--threads", "2", "--log-every", "1000"], texts=texts)
    return target, out, result


def test_saved_head_loads_like_a_downloaded_one(trained):
    target, out, result = trained
    with open(f"{target}/config.json") as f:
        tcfg = json.load(f)
    with open(f"{out}/config.json") as f:
        hcfg = json.load(f)
    assert hcfg["architectures"] == ["LlamaForCausalLMEagle3"] and hcfg["num_hidden_layers"] == 1
    assert hcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # layers 2, 4 // 2, 4 - 3 read
    head = load_eagle3_head(out, 64, torch.float32, torch.device("cpu"))
    c = head.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size) == \
        (tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["head_dim"],
         tcfg["intermediate_size"], tcfg["vocab_size"])
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == tcfg["rope_parameters"]["rope_theta"]
    assert c.draft_vocab_size == 96 and c.aux_layer_ids == (2, 2, 1)
    target_ids = head.to_target_ids(torch.arange(96))
    assert target_ids.min() >= 0 and target_ids.max() < c.vocab_size
    assert len(set(target_ids.tolist())) == 96
    assert torch.equal(target_ids, result["draft_ids"])
    from safetensors.torch import load_file
    tensors = load_file(f"{out}/model.safetensors")
    t2d = tensors.pop("t2d")
    assert t2d.dtype == torch.bool and t2d.shape == (c.vocab_size,)
    assert torch.equal(t2d.nonzero().flatten(), target_ids)
    assert set(tensors) == set(head.state_dict())  # no rotary cache, no embedding
    for name, t in head.state_dict().items():
        assert torch.equal(t, result["head"].state_dict()[name]), name


def test_training_lowers_the_loss(trained):
    _, _, result = trained
    assert result["eval_loss_after"] < result["eval_loss_before"]
    assert result["last_loss"] < result["first_loss"]
    assert len(result["step_accuracy"]) == 3 and result["accepted_length"] >= 1.0


def test_first_step_is_the_dense_causal_forward(trained):
    _, out, result = trained
    tokens, aux, embed = result["tokens"][0][None], result["aux"][0][None], result["embed"]
    with torch.no_grad():
        steps = trainer.ttt_forward(result["head"], embed, tokens, aux, 2)
        head = load_eagle3_head(out, 64, torch.float32, torch.device("cpu"))
        t = tokens.shape[1] - 1
        dense = head.forward_dense(embed[tokens[0, 1:]], aux[0, :t].float(), torch.arange(t))
        torch.testing.assert_close(head.logits(dense), result["head"].logits(steps[0][0]), rtol=1e-5, atol=1e-5)


def test_the_target_of_a_gguf_file_writes_minisrvs_tokens(tmp_path):
    """The trainer reads the target's hidden states from HF transformers on the weights minisrv serves
    (bench_offline.hf_model): for a GGUF file its greedy tokens and its hidden states are minisrv's own."""
    import sys
    from .helpers.gguf_writer import write_gguf
    from .helpers.tiny_models import greedy, make_llm, make_prompts, vocab_of
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_offline import hf_model
    hf_dir = build_tiny_model(str(tmp_path / "hf"), "llama", seed=4)
    gguf = str(tmp_path / "llama.gguf")
    write_gguf(hf_dir, gguf, "llama")
    prompt = make_prompts(vocab_of(hf_dir), [9], seed=2)[0]
    llm = make_llm(gguf, tokenizer=hf_dir, cache_dir="off")
    ours = llm.generate([prompt], greedy(8), use_tqdm=False)[0].token_ids
    llm.close()
    model = hf_model(gguf, torch.float32, torch.device("cpu"))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert ids[0, len(prompt):].tolist() == list(ours)


def test_generated_sequences_are_the_targets_greedy_answers(tmp_path):
    """--data generated: each sequence is its prompt and the target's greedy answer (HF transformers' greedy
    decoding on the same weights as the reference), learnt from the prompt's last position on; its code-edit
    prompts are over files the benchmark does not ask about."""
    import transformers
    import eagle3_data  # on the path the trainer's module put it on
    from offline_workloads import TRAINER_FIRST_FILE, code_edit_sources
    from .helpers.tiny_qwen2 import build_tiny_qwen2
    target = build_tiny_qwen2(str(tmp_path / "target"))
    seqs = eagle3_data.generated_sequences(target, 1, 2, 6, attention_backend="torch", dtype="float32",
                                           log_level="warning", disable_radix_cache=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    assert len(seqs) == 3
    for ids, first in seqs:
        prompt, answer = ids[:first + 1], ids[first + 1:]
        assert 1 <= len(answer) <= 6
        with torch.no_grad():
            reference = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer), do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert answer == reference
    code = tokenizer.decode(seqs[0][0][:seqs[0][1] + 1])
    assert f"Here is the file {code_edit_sources(TRAINER_FIRST_FILE + 1)[-1][0]}:" in code
    assert not any(path in code for path, _ in code_edit_sources(TRAINER_FIRST_FILE))
    assert eagle3_data.chat_instruction(1) in tokenizer.decode(seqs[2][0])
