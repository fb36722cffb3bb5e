#!/usr/bin/env python
"""Train an EAGLE-3 draft head for a target model on the CPU, in SpecForge's manner, and save it in the public
layout (config.json + model.safetensors) that minisrv's loader (minisrv/models/eagle3.py) and SGLang read.

Why: a head's acceptance can only be measured with a head that fits the target, and published heads exist for large
models only (and cannot be downloaded where there is no network). The head is small (one decoder layer) and learns
from the target alone, so minutes of CPU time give a usable one for a small target such as the default model.

How:
- Text: local files only: the standard library's Python sources, this repository's README.md and docs/*.md, and
  chat-format code-editing samples (a source file and an instruction to rewrite it, scripts/offline_workloads.py's
  prompt, answered with the file itself), packed into sequences of --seq-len tokens.
- The target (HF transformers, float32, on the weights minisrv serves) runs once over every sequence (no grad); kept
  in memory: the residual stream entering layers 2, N // 2 and N - 3 (HF's hidden_states[i]), concatenated (the
  head's input), its final normed hidden state (its logits over the draft vocabulary are the labels:
  self-distillation, so any text serves), and its argmax over the whole vocabulary (what acceptance is scored on).
- Draft vocabulary: the --draft-vocab-size ids the target predicts most often over the text (topped up with the
  most frequent text tokens, then the lowest ids, to the size asked), in id order; d2t[i] = target id - i.
- The head starts with the target's lm_head rows of the draft vocabulary and a tenth of its final norm (so that
  its first logits are nearly uniform rather than confidently wrong): it first has to learn only to produce
  something like the target's last hidden state.
- Training-time test (EAGLE-3), --ttt-steps deep: entry p pairs the target's hidden state at p with the embedding
  of token p + 1 and learns the target's distribution at p + 1 (of token p + 2). Step j >= 1 reruns the head at
  position p + j on its own step j - 1 output of base p (no fc) and the embedding of token p + 1 + j, as chained
  drafting does. Its queries see the step-0 keys of positions 0..p and the keys of steps 1..j of the same base
  (the diagonal), as serving's paged cache holds them. Loss: the soft cross-entropy of each step, weighted 0.8^j.
- Scored on a held-out split: per step, how often the draft's argmax is the target's; the expected accepted length
  of a chain of drafts, 1 + sum_j prod_{i<=j} acc_i, is the proxy for the mean tokens a verify step keeps.

  python scripts/train_eagle3.py --out /tmp/eagle-smollm2          # the default model, a few minutes on 2 cores
  python -m minisrv.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/eagle-smollm2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minisrv.checkpoints.loader import load_hf_config, load_tokenizer, resolve_model_path  # noqa: E402
from minisrv.models.args import ModelArgs  # noqa: E402
from minisrv.models.eagle3 import Eagle3Config, Eagle3Head, attend  # noqa: E402
from offline_workloads import REPO_ROOT, code_edit_messages  # noqa: E402

STEP_DECAY = 0.8  # the weight of step j's loss is STEP_DECAY ** j
NORM_START = 0.1  # the head's final norm starts at this share of the target's: its first logits nearly uniform
HELD_OUT = 0.1  # the share of sequences scored, not trained on


# --- text ---

def training_texts(tokenizer, chars: int, seed: int) -> List[str]:
    """About `chars` characters of local text, in an order fixed by `seed`: the repository's documentation (up to
    a fifth of it), then pieces of standard-library sources, three in four of them as chat-format code-editing
    samples short enough that the request and its answer (the piece copied) fall in one training sequence: what the
    head learns to copy from."""
    rng = random.Random(seed)
    docs = [REPO_ROOT / "README.md"] + sorted((REPO_ROOT / "docs").glob("*.md"))
    texts: List[str] = []
    for doc in rng.sample(docs, len(docs)):
        room = chars // 5 - sum(map(len, texts))
        if room <= 0:
            break
        texts.append(doc.read_text()[:room])
    stdlib = os.path.dirname(os.__file__)
    files = sorted(os.path.join(d, f) for d, sub, names in os.walk(stdlib)
                   if "site-packages" not in d and "dist-packages" not in d for f in names if f.endswith(".py"))
    rng.shuffle(files)
    total = sum(map(len, texts))
    for i, path in enumerate(files):
        if total >= chars:
            break
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines(True)
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) < 20:
            continue
        start = rng.randrange(max(1, len(lines) - 150))
        chat = i % 4 != 0
        code = "".join(lines[start:start + (rng.randint(8, 24) if chat else 400)])
        if chat:  # a code-editing sample: a piece of the file, and its copy as the answer, within one sequence
            code = chat_sample(tokenizer, os.path.relpath(path, stdlib), code, i)
        texts.append(code)
        total += len(code)
    return texts


def chat_sample(tokenizer, path: str, code: str, i: int) -> str:
    messages = code_edit_messages(path, code, i) + [{"role": "assistant", "content": f"```python\n{code}```"}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n\n".join(m["content"] for m in messages)


def token_sequences(tokenizer, texts: Sequence[str], seq_len: int, max_tokens: int, seed: int) -> torch.Tensor:
    """The texts (shuffled by `seed`) tokenized, joined by the end-of-sequence token and cut into rows of seq_len:
    [rows, seq_len], at most max_tokens in all."""
    order = list(texts)
    random.Random(seed).shuffle(order)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: List[int] = []
    for text in order:
        stream += tokenizer(text, add_special_tokens=False).input_ids + [eos]
        if len(stream) >= max_tokens:
            break
    rows = min(len(stream), max_tokens) // seq_len
    if rows < 2:
        raise ValueError(f"the text gives {len(stream)} tokens: fewer than two sequences of {seq_len}")
    return torch.tensor(stream[:rows * seq_len]).view(rows, seq_len)


# --- the target ---

def layers_read(num_layers: int) -> Tuple[int, int, int]:
    """The target layers whose input the head reads (EAGLE-3's choice: low, middle, high)."""
    return (2, num_layers // 2, num_layers - 3)


@torch.no_grad()
def target_states(model, seqs: torch.Tensor, layers: Sequence[int], batch: int = 4) -> Dict[str, torch.Tensor]:
    """What training needs of the target, per sequence and position: `aux` [R, S, 3 x hidden] (bfloat16) the
    residual streams entering `layers`, `final` [R, S, hidden] its last normed hidden state, `argmax` [R, S] its
    greedy next token over the whole vocabulary."""
    aux, final, argmax = [], [], []
    for i in range(0, seqs.shape[0], batch):
        out = model(seqs[i:i + batch], output_hidden_states=True)
        hs = out.hidden_states
        aux.append(torch.cat([hs[layer] for layer in layers], dim=-1).to(torch.bfloat16))
        final.append(hs[-1].float())
        argmax.append(out.logits.argmax(-1))
    return {"tokens": seqs, "aux": torch.cat(aux), "final": torch.cat(final), "argmax": torch.cat(argmax)}


def draft_vocabulary(argmax: torch.Tensor, tokens: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The `size` target ids (sorted) the target predicts most often; topped up with the most frequent tokens of
    the text, then the lowest ids not yet in, so that every id appears once."""
    size = min(size, vocab)
    chosen: List[int] = []
    seen = torch.zeros(vocab, dtype=torch.bool)
    for counts in (torch.bincount(argmax.flatten(), minlength=vocab), torch.bincount(tokens.flatten(), minlength=vocab)):
        for tid in counts.argsort(descending=True, stable=True).tolist():
            if len(chosen) == size or counts[tid] == 0:
                break
            if not seen[tid]:
                seen[tid] = True
                chosen.append(tid)
    chosen += (~seen).nonzero().flatten()[:size - len(chosen)].tolist()
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def head_config(cfg: Dict, layers: Sequence[int], draft_vocab: int) -> Eagle3Config:
    """The head's shape: the target's attention shape, rotary and MLP width, so that its keys and values are shaped
    as one of the target's layers'."""
    a = ModelArgs.from_hf_config(cfg)
    return Eagle3Config(a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps,
                        a.rope_theta, a.rope_scaling, a.vocab_size, draft_vocab, a.hidden_size, tuple(layers))


# --- the head's training-time test ---

def ttt_mask(t: int, step: int) -> torch.Tensor:
    """[t, (step + 1) t] bool: which keys [K_0, K_1, ..., K_step] a step-`step` query of base p may see: the step-0
    keys of positions 0..p, and of each later step the key of the same base only."""
    eye = torch.eye(t, dtype=torch.bool)
    return torch.cat([torch.ones(t, t, dtype=torch.bool).tril()] + [eye] * step, dim=1)


def ttt_forward(head: Eagle3Head, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor,
                steps: int) -> List[torch.Tensor]:
    """The head's pre-norm outputs [B, T, hidden] (T = S - 1 bases) of each step, for sequences tokens [B, S] with
    the target's hidden states aux [B, S, 3 x hidden]. Step j's entry of base p sits at position p + j and reads
    token p + 1 + j (clamped at the end: such entries have no label and are not scored)."""
    b, s = tokens.shape
    t = s - 1
    base = torch.arange(t)
    hidden = aux[:, :t].float().reshape(b * t, -1)
    keys: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    outs = []
    for j in range(steps):
        at = (base + j).clamp(max=s - 2)
        embeds = embed[tokens[:, at + 1]].reshape(b * t, -1)
        q, k, v, residual = head.qkv(embeds, hidden, (base + j).repeat(b))
        keys.append(k.view(b, t, *k.shape[1:]))
        values.append(v.view(b, t, *v.shape[1:]))
        q = q.view(b, t, *q.shape[1:])
        mask = ttt_mask(t, j)
        attn = torch.stack([attend(q[i], torch.cat([kk[i] for kk in keys]), torch.cat([vv[i] for vv in values]),
                                   causal=False, mask=mask) for i in range(b)])
        out = head.finish(attn.reshape(b * t, *attn.shape[2:]), residual)
        outs.append(out.view(b, t, -1))
        hidden = out
    return outs


def ttt_losses(head: Eagle3Head, outs: List[torch.Tensor], final: torch.Tensor, argmax: torch.Tensor,
               target_rows: torch.Tensor, draft_ids: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor],
                                                                             List[torch.Tensor]]:
    """The weighted loss, and per step its soft cross-entropy and top-1 agreement with the target's argmax (step j
    of base p is labelled by the target at position p + 1 + j; bases past the end are left out)."""
    b, t = outs[0].shape[:2]
    s = t + 1
    base = torch.arange(t)
    total, losses, accs = 0.0, [], []
    for j, out in enumerate(outs):
        at = base + 1 + j
        valid = at < s
        at = at[valid]
        logits = head.logits(out[:, valid])
        labels = F.softmax(final[:, at] @ target_rows.T, dim=-1)
        loss = -(labels * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + STEP_DECAY ** j * loss
        losses.append(loss.detach())
        accs.append((draft_ids[logits.argmax(-1)] == argmax[:, at]).float().mean())
    return total, losses, accs


@torch.no_grad()
def evaluate(head, embed, data, rows, target_rows, draft_ids, steps, batch) -> Tuple[float, List[float]]:
    """Held-out loss and per-step top-1 agreement, averaged over the rows."""
    loss, accs = 0.0, [0.0] * steps
    chunks = [rows[i:i + batch] for i in range(0, len(rows), batch)]
    for r in chunks:
        outs = ttt_forward(head, embed, data["tokens"][r], data["aux"][r], steps)
        total, _, acc = ttt_losses(head, outs, data["final"][r], data["argmax"][r], target_rows, draft_ids)
        loss += float(total) * len(r) / len(rows)
        accs = [a + float(x) * len(r) / len(rows) for a, x in zip(accs, acc)]
    return loss, accs


def expected_accepted_length(accs: Sequence[float]) -> float:
    """1 (the target's own token) + the expected number of drafts of a chain kept, if step j is right with
    probability accs[j] whenever the steps before it were."""
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


# --- saving ---

def save_head(head: Eagle3Head, out: str, draft_ids: torch.Tensor, max_positions: int) -> None:
    """config.json and model.safetensors in the public EAGLE-3 layout (the head's tensors, d2t, and t2d: True for
    target ids in the draft vocabulary); no rotary cache and no embedding (the target's is used)."""
    from safetensors.torch import save_file
    c = head.config
    os.makedirs(out, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
              "max_position_embeddings": max_positions, "vocab_size": c.vocab_size,
              "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
              "tie_word_embeddings": False, "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids]}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: v.detach().contiguous().clone() for k, v in head.state_dict().items()}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, os.path.join(out, "model.safetensors"))


# --- the run ---

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the head's directory (written)")
    p.add_argument("--model", default=None, help="the target: a GGUF file or a HF directory (default model)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time test depth (chained drafts)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32768, help="tokens of text in all (held-out split included)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences a step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="share of the steps the learning rate warms up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, texts: Optional[Sequence[str]] = None) -> Dict:
    """Train and save a head; returns its figures (and the head). `texts`: the text to train on, instead of the
    local files."""
    from bench_offline import hf_model
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    path = resolve_model_path(a.model)
    cfg = load_hf_config(path)
    tokenizer = load_tokenizer(path)
    model = hf_model(path, torch.float32, torch.device("cpu"))
    if texts is None:
        texts = training_texts(tokenizer, 6 * a.max_tokens, a.seed)
    seqs = token_sequences(tokenizer, texts, a.seq_len, a.max_tokens, a.seed)
    layers = layers_read(cfg["num_hidden_layers"])
    data = target_states(model, seqs, layers, a.batch)
    t_target = time.perf_counter() - t0
    print(f"target: {seqs.numel()} tokens ({seqs.shape[0]} sequences of {a.seq_len}), hidden states of layers "
          f"{layers} in {t_target:.1f} s", flush=True)

    rows = seqs.shape[0]
    held = max(1, round(HELD_OUT * rows))
    train_rows, eval_rows = list(range(rows - held)), list(range(rows - held, rows))
    # the draft vocabulary is chosen on the training rows only
    draft_ids = draft_vocabulary(data["argmax"][:rows - held], seqs[:rows - held], cfg["vocab_size"],
                                 a.draft_vocab_size)
    target_rows = model.lm_head.weight.detach()[draft_ids].float()
    embed = model.get_input_embeddings().weight.detach().float()
    max_positions = a.seq_len + a.ttt_steps
    head = Eagle3Head(head_config(cfg, layers, len(draft_ids)), max_positions)
    with torch.no_grad():
        head.lm_head.weight.copy_(target_rows)
        head.norm.weight.copy_(NORM_START * model.model.norm.weight.float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    del model

    covered = float((data["argmax"][rows - held:, :, None] == draft_ids).any(-1).float().mean())
    before, accs0 = evaluate(head, embed, data, eval_rows, target_rows, draft_ids, a.ttt_steps, a.batch)
    print(f"draft vocabulary {len(draft_ids)} ids: they hold the target's argmax at {covered:.1%} of held-out "
          f"positions; held-out loss before training {before:.3f}, top-1 {', '.join(f'{x:.1%}' for x in accs0)}",
          flush=True)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(train_rows) / a.batch)
    total_steps = per_epoch * a.epochs
    warm = max(1, round(a.warmup * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / warm if i < warm else
                                              0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, total_steps - warm))))
    gen = torch.Generator().manual_seed(a.seed)
    step, first_loss, last_loss, t1 = 0, None, None, time.perf_counter()
    for epoch in range(a.epochs):
        order = torch.tensor(train_rows)[torch.randperm(len(train_rows), generator=gen)].tolist()
        for i in range(0, len(order), a.batch):
            r = order[i:i + a.batch]
            outs = ttt_forward(head, embed, data["tokens"][r], data["aux"][r], a.ttt_steps)
            loss, _, accs = ttt_losses(head, outs, data["final"][r], data["argmax"][r], target_rows, draft_ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            last_loss = float(loss.detach())
            first_loss = last_loss if first_loss is None else first_loss
            if step % a.log_every == 0 or step == total_steps:
                print(f"epoch {epoch + 1} step {step}/{total_steps} loss {last_loss:.3f} top-1 "
                      f"{' '.join(f'{float(x):.1%}' for x in accs)} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.perf_counter() - t1:.0f} s", flush=True)
    t_train = time.perf_counter() - t1
    after, accs = evaluate(head, embed, data, eval_rows, target_rows, draft_ids, a.ttt_steps, a.batch)
    save_head(head, a.out, draft_ids, max(max_positions, cfg.get("max_position_embeddings", max_positions)))
    length = expected_accepted_length(accs)
    trained = len(train_rows) * a.seq_len
    wall = time.perf_counter() - t0
    print(f"trained on {trained} tokens x {a.epochs} epochs ({step} steps) in {t_train:.0f} s; target states "
          f"{t_target:.0f} s; wall time {wall:.0f} s")
    print(f"held-out ({held * a.seq_len} tokens): loss {before:.3f} -> {after:.3f}; top-1 agreement with the "
          f"target by draft step: {', '.join(f'{x:.1%}' for x in accs)}")
    print(f"expected accepted length of a {a.ttt_steps}-draft chain: {length:.2f} tokens a verify step (the "
          f"target's own token plus the drafts kept, if each draft is kept exactly when it is the target's greedy "
          f"choice and step j is right as often as held out); saved to {a.out}")
    return {"head": head, "draft_ids": draft_ids, "tokens": data["tokens"], "aux": data["aux"], "embed": embed,
            "first_loss": first_loss, "last_loss": last_loss, "eval_loss_before": before,
            "eval_loss_after": after, "step_accuracy": accs, "accepted_length": length,
            "trained_tokens": trained, "wall_s": wall}


if __name__ == "__main__":
    main()
