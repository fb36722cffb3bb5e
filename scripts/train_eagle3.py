#!/usr/bin/env python
"""Train an EAGLE-3 draft head for a target model on the CPU, in SpecForge's manner, and save it in the public
layout (config.json + model.safetensors) that minisrv's loader (minisrv/models/eagle3.py) and SGLang read.

Why: a head's acceptance can only be measured with a head that fits the target, and published heads exist for large
models only (and cannot be downloaded where there is no network). The head is small (one decoder layer) and learns
from the target alone, so minutes of CPU time give a usable one for a small target such as the default model.

How:
- Text (scripts/eagle3_data.py): by default the target's own greedy answers, through minisrv's engine, to chat
  prompts (the code-edit workload's over torch sources the benchmark does not use, and general instructions); a
  sequence is a prompt and its answer, and the head learns the answer's positions while attending over the whole
  (the file an answer copies lies in its prompt). `--data local`: local files packed into rows of --seq-len.
- The target (HF transformers, float32, on the weights minisrv serves) runs once over every sequence (no grad); kept
  in memory: the residual stream entering layers 2, N // 2 and N - 3 (HF's hidden_states[i]), concatenated (the
  head's input), its final normed hidden state (its logits over the draft vocabulary are the labels:
  self-distillation), and its argmax over the whole vocabulary (what acceptance is scored on).
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

On the default model, with the defaults, the head agrees with the target's greedy token at 18-28% of held-out
positions (draft step 3 to 1) and keeps a mean of 1.4 tokens a verify step on bench_offline's code-edit workload
(docs/benchmarks.md, "Speculative decoding (CPU ...)": its command, time and speed).

  python scripts/train_eagle3.py --out /tmp/eagle-smollm2 --threads 2   # the default model: half an hour on 2 cores
  python -m minisrv.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/eagle-smollm2
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
from eagle3_data import TrainingSequence, training_sequences  # noqa: E402

STEP_DECAY = 0.8  # the weight of step j's loss is STEP_DECAY ** j
NORM_START = 0.1  # the head's final norm starts at this share of the target's: its first logits nearly uniform
HELD_OUT = 0.1  # the share of sequences scored, not trained on


# --- the target ---

def layers_read(num_layers: int) -> Tuple[int, int, int]:
    """The target layers whose input the head reads (EAGLE-3's choice: low, middle, high)."""
    return (2, num_layers // 2, num_layers - 3)


@torch.no_grad()
def target_states(model, seqs: Sequence[TrainingSequence], layers: Sequence[int]) -> Dict[str, List[torch.Tensor]]:
    """What training needs of the target, a list entry per sequence ([S] or [S, ...] each): `tokens`; `aux`
    [S, 3 x hidden] (bfloat16) the residual streams entering `layers`; `final` [S, hidden] its last normed hidden
    state; `argmax` its greedy next token over the whole vocabulary; `scored` (bool) where it is learnt."""
    data: Dict[str, List[torch.Tensor]] = {"tokens": [], "aux": [], "final": [], "argmax": [], "scored": []}
    for ids, first in seqs:
        tokens = torch.tensor(ids)
        out = model(tokens[None], output_hidden_states=True)
        hs = out.hidden_states
        data["tokens"].append(tokens)
        data["aux"].append(torch.cat([hs[layer][0] for layer in layers], dim=-1).to(torch.bfloat16))
        data["final"].append(hs[-1][0].float())
        data["argmax"].append(out.logits[0].argmax(-1))
        data["scored"].append(torch.arange(len(ids)) >= first)
    return data


def one_row(data: Dict[str, List[torch.Tensor]], i: int) -> Dict[str, torch.Tensor]:
    """Sequence i's entries, each as a batch of one."""
    return {k: v[i][None] for k, v in data.items()}


def draft_vocabulary(argmax: torch.Tensor, tokens: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The `size` target ids (sorted) the target predicts most often; topped up with the most frequent tokens of
    the text, then the lowest ids not yet in, so that every id appears once."""
    size = min(size, vocab)
    chosen: List[int] = []
    seen = torch.zeros(vocab, dtype=torch.bool)
    for counts in (torch.bincount(argmax.flatten(), minlength=vocab),
                   torch.bincount(tokens.flatten(), minlength=vocab)):
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


def ttt_losses(head: Eagle3Head, outs: List[torch.Tensor], row: Dict[str, torch.Tensor], target_rows: torch.Tensor,
               draft_ids: torch.Tensor) -> Tuple[torch.Tensor, List[float], List[int], List[int]]:
    """The weighted loss, and per step its soft cross-entropy, how many drafts agree with the target's argmax and
    of how many (step j of base p is labelled by the target at position p + 1 + j; bases past the end, and labels
    at positions not scored, are left out)."""
    b, t = outs[0].shape[:2]
    s = t + 1
    base = torch.arange(t)
    total, losses, hits, counts = 0.0, [], [], []
    for j, out in enumerate(outs):
        at = (base + 1 + j).clamp(max=s - 1)
        valid = (base + 1 + j < s) & row["scored"][:, at]
        count = int(valid.sum())
        if count == 0:
            losses.append(0.0), hits.append(0), counts.append(0)
            continue
        logits = head.logits(out[valid])
        labels = F.softmax(row["final"][:, at][valid] @ target_rows.T, dim=-1)
        loss = -(labels * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + STEP_DECAY ** j * loss
        losses.append(float(loss.detach()))
        hits.append(int((draft_ids[logits.argmax(-1)] == row["argmax"][:, at][valid]).sum()))
        counts.append(count)
    return total, losses, hits, counts


@torch.no_grad()
def evaluate(head, embed, data, rows, target_rows, draft_ids, steps) -> Tuple[float, List[float]]:
    """Held-out loss (a mean over the sequences, weighted by their positions scored) and per-step top-1 agreement
    over all their drafts."""
    loss, weight, hits, counts = 0.0, 0, [0] * steps, [0] * steps
    for i in rows:
        row = one_row(data, i)
        outs = ttt_forward(head, embed, row["tokens"], row["aux"], steps)
        total, _, hit, count = ttt_losses(head, outs, row, target_rows, draft_ids)
        loss += float(total) * count[0]
        weight += count[0]
        hits = [h + x for h, x in zip(hits, hit)]
        counts = [c + x for c, x in zip(counts, count)]
    return loss / max(weight, 1), [h / max(c, 1) for h, c in zip(hits, counts)]


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
    p.add_argument("--data", choices=("generated", "local"), default="generated",
                   help="generated: the target's answers to chat prompts; local: local files (scripts/eagle3_data.py)")
    p.add_argument("--code-prompts", type=int, default=44, help="generated: code-edit prompts answered")
    p.add_argument("--chat-prompts", type=int, default=16, help="generated: general instructions answered")
    p.add_argument("--max-new-tokens", type=int, default=512, help="generated: the longest answer")
    p.add_argument("--sequences", default=None, help="generated: a JSON file the answers are read from if it "
                   "exists, else written to (the target's answers, made once for several trainings)")
    p.add_argument("--seq-len", type=int, default=512, help="local: the rows' length")
    p.add_argument("--max-tokens", type=int, default=32768, help="local: tokens of text in all (held-out included)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time test depth (chained drafts)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=1, help="sequences a step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="share of the steps the learning rate warms up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, texts: Optional[Sequence[str]] = None) -> Dict:
    """Train and save a head; returns its figures (and the head). `texts`: text to train on (packed as --data
    local packs its files), instead of --data's source."""
    from bench_offline import hf_model
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    path = resolve_model_path(a.model)
    cfg = load_hf_config(path)
    tokenizer = load_tokenizer(path)
    seqs = training_sequences(a, path, tokenizer, texts)
    t_text = time.perf_counter() - t0
    print(f"text ({a.data if texts is None else 'given'}): {len(seqs)} sequences, {sum(len(s) for s, _ in seqs)} "
          f"tokens ({sum(len(s) - first for s, first in seqs)} learnt) in {t_text:.0f} s", flush=True)
    model = hf_model(path, torch.float32, torch.device("cpu"))
    layers = layers_read(cfg["num_hidden_layers"])
    data = target_states(model, seqs, layers)
    scored = [int(x.sum()) for x in data["scored"]]
    t_target = time.perf_counter() - t0 - t_text
    print(f"the target's hidden states of layers {layers} in {t_target:.0f} s", flush=True)

    rows = len(seqs)
    held = max(1, round(HELD_OUT * rows))
    train_rows, eval_rows = list(range(rows - held)), list(range(rows - held, rows))
    # the draft vocabulary is chosen on the training rows only
    draft_ids = draft_vocabulary(torch.cat([data["argmax"][i][data["scored"][i]] for i in train_rows]),
                                 torch.cat(data["tokens"][:rows - held]), cfg["vocab_size"], a.draft_vocab_size)
    target_rows = model.lm_head.weight.detach()[draft_ids].float()
    embed = model.get_input_embeddings().weight.detach().float()
    max_positions = max(map(len, data["tokens"])) + a.ttt_steps
    head = Eagle3Head(head_config(cfg, layers, len(draft_ids)), max_positions)
    with torch.no_grad():
        head.lm_head.weight.copy_(target_rows)
        head.norm.weight.copy_(NORM_START * model.model.norm.weight.float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    del model

    held_argmax = torch.cat([data["argmax"][i][data["scored"][i]] for i in eval_rows])
    covered = float((held_argmax[:, None] == draft_ids).any(-1).float().mean())
    before, accs0 = evaluate(head, embed, data, eval_rows, target_rows, draft_ids, a.ttt_steps)
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
            opt.zero_grad(set_to_none=True)
            loss, hits, counts = 0.0, [0] * a.ttt_steps, [0] * a.ttt_steps
            for r in order[i:i + a.batch]:  # one sequence at a time (their lengths differ), gradients summed
                row = one_row(data, r)
                outs = ttt_forward(head, embed, row["tokens"], row["aux"], a.ttt_steps)
                total, _, hit, count = ttt_losses(head, outs, row, target_rows, draft_ids)
                (total / len(order[i:i + a.batch])).backward()
                loss += float(total.detach()) / len(order[i:i + a.batch])
                hits = [h + x for h, x in zip(hits, hit)]
                counts = [c + x for c, x in zip(counts, count)]
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            last_loss = loss
            first_loss = last_loss if first_loss is None else first_loss
            if step % a.log_every == 0 or step == total_steps:
                print(f"epoch {epoch + 1} step {step}/{total_steps} loss {last_loss:.3f} top-1 "
                      f"{' '.join(f'{h / max(c, 1):.1%}' for h, c in zip(hits, counts))} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.perf_counter() - t1:.0f} s", flush=True)
    t_train = time.perf_counter() - t1
    after, accs = evaluate(head, embed, data, eval_rows, target_rows, draft_ids, a.ttt_steps)
    save_head(head, a.out, draft_ids, max(max_positions, cfg.get("max_position_embeddings", max_positions)))
    length = expected_accepted_length(accs)
    trained = sum(scored[i] for i in train_rows)
    wall = time.perf_counter() - t0
    print(f"trained on {trained} tokens x {a.epochs} epochs ({step} steps) in {t_train:.0f} s; text {t_text:.0f} s; "
          f"target states {t_target:.0f} s; wall time {wall:.0f} s")
    print(f"held-out ({sum(scored[i] for i in eval_rows)} tokens in {held} sequences): loss {before:.3f} -> "
          f"{after:.3f}; top-1 agreement with the target by draft step: {', '.join(f'{x:.1%}' for x in accs)}")
    print(f"expected accepted length of a {a.ttt_steps}-draft chain: {length:.2f} tokens a verify step (the "
          f"target's own token plus the drafts kept, if each draft is kept exactly when it is the target's greedy "
          f"choice and step j is right as often as held out); saved to {a.out}")
    return {"head": head, "draft_ids": draft_ids, "tokens": data["tokens"], "aux": data["aux"], "embed": embed,
            "first_loss": first_loss, "last_loss": last_loss, "eval_loss_before": before,
            "eval_loss_after": after, "step_accuracy": accs, "accepted_length": length,
            "trained_tokens": trained, "wall_s": wall}


if __name__ == "__main__":
    main()
