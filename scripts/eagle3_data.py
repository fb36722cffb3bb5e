"""What scripts/train_eagle3.py trains a head on: sequences of token ids, each with the first position whose
prediction the head learns (a TrainingSequence).

- generated (the default): the target's own answers, as SpecForge advises (regenerate the data with the target, so
  that the head learns to draft what the target says rather than what some other writer wrote). Chat prompts,
  answered greedily by the target through minisrv's engine (minisrv.LLM, every prompt in one batch): the code-edit
  workload's prompts (scripts/offline_workloads.py) over torch sources that the benchmark does not use, and general
  instructions (CHAT_TASKS about CHAT_TOPICS). A sequence is the prompt and its answer; the head learns the answer's
  positions only, attending over the prompt as it does when serving (where a copy's source lies).
- local: local files only (the standard library's Python sources, this repository's README.md and docs/*.md, and
  code-editing chats answered with the file itself), packed into rows of --seq-len tokens, every position learnt.
"""
from __future__ import annotations

import json
import os
import random
from typing import List, Optional, Sequence, Tuple

from offline_workloads import REPO_ROOT, TRAINER_FIRST_FILE, code_edit_messages, code_edit_workload

TrainingSequence = Tuple[List[int], int]  # token ids, and the first position whose next token is learnt

CHAT_TASKS = ("Explain {} to a beginner, in a few short paragraphs.",
              "Write a Python function that has to do with {}, with a docstring and a short usage example.",
              "List five important facts about {}, one line each.",
              "Write a short story in which {} plays a part.",
              "What are the most common mistakes people make with {}? Answer as a numbered list.",
              "Summarize what an expert should know about {} in one paragraph.")
CHAT_TOPICS = ("binary search", "hash tables", "recursion", "unit testing", "regular expressions", "HTTP requests",
               "sorting a list in Python", "git branches", "SQL joins", "JSON parsing", "linked lists",
               "Python classes", "exceptions in Python", "reading a CSV file", "photosynthesis", "the water cycle",
               "volcanoes", "the solar system", "the French Revolution", "healthy sleep", "baking bread",
               "learning a language", "climate change", "prime numbers", "the Pythagorean theorem", "saving money",
               "time management", "the human heart", "electric cars", "the Roman Empire")


def chat_instruction(i: int) -> str:
    """General instruction number i: task i % 6 about a topic that cycles independently of the task."""
    return CHAT_TASKS[i % len(CHAT_TASKS)].format(CHAT_TOPICS[(i * 7) % len(CHAT_TOPICS)])


def generated_sequences(model: str, code_prompts: int, chat_prompts: int, max_new_tokens: int,
                        **engine_options) -> List[TrainingSequence]:
    """The target's greedy answers (up to max_new_tokens each, ended by its end of turn) to `code_prompts`
    code-edit prompts over the files from offline_workloads.TRAINER_FIRST_FILE on, and to `chat_prompts` general
    instructions; each returned as (prompt + answer, len(prompt) - 1): the prediction made at the prompt's last
    token is the answer's first."""
    from minisrv.engine.request import SamplingParams
    from minisrv.llm import LLM
    llm = LLM(model=model, **engine_options)
    try:
        prompts, params = code_edit_workload(llm, code_prompts, max_new_tokens, first=TRAINER_FIRST_FILE)
        for i in range(chat_prompts):
            prompts.append(llm.encode_chat([{"role": "user", "content": chat_instruction(i)}]))
            params.append(SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    return [(list(p) + list(o.token_ids), len(p) - 1) for p, o in zip(prompts, outs)]


def local_texts(tokenizer, chars: int, seed: int) -> List[str]:
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


def packed_sequences(tokenizer, texts: Sequence[str], seq_len: int, max_tokens: int,
                     seed: int) -> List[TrainingSequence]:
    """The texts (shuffled by `seed`) tokenized, joined by the end-of-sequence token and cut into rows of seq_len
    tokens (at most max_tokens in all), every position learnt."""
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
    return [(stream[i * seq_len:(i + 1) * seq_len], 0) for i in range(rows)]


def training_sequences(args, model: str, tokenizer, texts: Optional[Sequence[str]]) -> List[TrainingSequence]:
    """The sequences the trainer's arguments ask for (--data), in an order fixed by --seed; `texts`, where given,
    packed instead of any source."""
    if texts is None and args.data == "generated":
        if args.sequences and os.path.exists(args.sequences):
            with open(args.sequences) as f:
                seqs = [(ids, first) for ids, first in json.load(f)]
        else:
            seqs = generated_sequences(model, args.code_prompts, args.chat_prompts, args.max_new_tokens)
            if args.sequences:
                with open(args.sequences, "w") as f:
                    json.dump(seqs, f)
        random.Random(args.seed).shuffle(seqs)
        return seqs
    if texts is None:
        texts = local_texts(tokenizer, 6 * args.max_tokens, args.seed)
    return packed_sequences(tokenizer, texts, args.seq_len, args.max_tokens, args.seed)
