"""The request sets of scripts/bench_offline.py (its docstring says what each one is), built from fixed seeds so that
every run of a workload asks for the same work."""
from __future__ import annotations

import difflib
import hashlib
import os
import random
import re
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from minisrv.engine.request import SamplingParams

Workload = Tuple[List[List[int]], List[SamplingParams]]


def nano_workload(n: int, in_range, out_range, seed: int = 0) -> Workload:
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(*in_range))] for _ in range(n)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(*out_range))
              for _ in range(n)]
    return prompts, params


def shared_workload(n: int, num_systems: int = 8, seed: int = 0) -> Workload:
    random.seed(seed)
    systems = [[random.randint(0, 10000) for _ in range(random.randint(800, 1200))] for _ in range(num_systems)]
    prompts = [systems[i % num_systems] + [random.randint(0, 10000) for _ in range(random.randint(20, 200))]
               for i in range(n)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(50, 300)) for _ in range(n)]
    order = list(range(n))
    random.shuffle(order)
    return [prompts[i] for i in order], [params[i] for i in order]


def prefix_workload(num_prefixes: int, prefix_len: int, per_prefix: int, out_range, seed: int = 0) -> Workload:
    random.seed(seed)
    prefixes = [[random.randint(0, 10000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts, params = [], []
    for p in prefixes:
        for _ in range(per_prefix):
            prompts.append(p + [random.randint(0, 10000) for _ in range(random.randint(16, 256))])
            params.append(SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(*out_range)))
    order = list(range(len(prompts)))
    random.shuffle(order)
    return [prompts[i] for i in order], [params[i] for i in order]


def cpu_workload(n: int, in_range, out_len: int, seed: int = 0) -> Workload:
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(*in_range))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len) for _ in range(n)]
    return prompts, params


# --- code-edit: rewrite a source file whole with one small change, so that the answer mostly copies the prompt ---

REPO_ROOT = Path(__file__).resolve().parent.parent


def code_edit_sources(n: int, min_lines: int = 60, max_lines: int = 150) -> List[Tuple[str, str]]:
    """n (path, text) pairs: the Python files of the installed torch package (setup.sh pins its version, so the
    workload stays the same while minisrv changes) of min_lines..max_lines lines, in the order of their paths'
    SHA-256, cycled when n is larger."""
    import torch
    root = Path(torch.__file__).resolve().parent
    files = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        if min_lines <= text.count("\n") <= max_lines:
            files.append(("torch/" + str(path.relative_to(root)), text))
    if not files:
        raise RuntimeError(f"no file of {min_lines}-{max_lines} lines under {root}")
    files.sort(key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())
    return [files[i % len(files)] for i in range(n)]


def edit_instruction(path: str, text: str, i: int) -> str:
    """One small change to ask of file number i: renaming its first function or class, or adding a line to its
    module docstring, in turn (the docstring line where the file defines no such name)."""
    funcs = re.findall(r"^\s*def ([A-Za-z_]\w*)\(", text, re.M)
    classes = re.findall(r"^class ([A-Za-z_]\w*)", text, re.M)
    kind = i % 3
    if kind == 0 and funcs:
        name = next((f for f in funcs if not f.startswith("__")), funcs[0])
        return f"Rename the function `{name}` to `{name.strip('_')}_renamed`, here and wherever the file uses it."
    if kind == 1 and classes:
        return f"Rename the class `{classes[0]}` to `{classes[0]}V2`, here and wherever the file uses it."
    module = os.path.splitext(path)[0].replace(os.sep, ".")
    return f"Add the line `Module: {module}.` as the last line of the module docstring."


TRAINER_FIRST_FILE = 64  # the files before this one are left to the benchmark (--num-prompts up to 64)
ANSWER_HEAD_LINES = 3  # the file's first lines, given as the start of the answer


def code_edit_messages(path: str, text: str, i: int) -> List[Dict[str, str]]:
    return [{"role": "user", "content": f"Here is the file {path}:\n\n```python\n{text}```\n\n"
                                        f"{edit_instruction(path, text, i)} Change nothing else. Reply with the "
                                        f"complete rewritten file."}]


def code_edit_workload(llm, n: int, max_tokens: int, first: int = 0) -> Workload:
    """Chat-templated prompts for `llm` (minisrv.LLM), each followed by the start of its answer: a code fence and
    the file's first ANSWER_HEAD_LINES lines (asked cold, a small model such as SmolLM2-135M tends to describe the
    file or wander off after a few lines; once its answer has started as a copy, it goes on copying). Greedy, ended
    by the model's end of turn or max_tokens. `first`: the files from that one on (the benchmark takes the first
    ones; the EAGLE-3 trainer asks from TRAINER_FIRST_FILE on, so that it never sees the benchmark's)."""
    prompts = []
    for i, (path, text) in enumerate(code_edit_sources(first + n)[first:], start=first):
        head = "".join(text.splitlines(True)[:ANSWER_HEAD_LINES])
        answer_start = llm.tokenizer("```python\n" + head, add_special_tokens=False).input_ids
        prompts.append(llm.encode_chat(code_edit_messages(path, text, i)) + answer_start)
    return prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _ in prompts]


def copied_fraction(prompt: Sequence[int], output: Sequence[int], n: int = 8) -> float:
    """The share of output tokens that lie inside some n-gram of the output that also occurs in the prompt: how much
    of the answer a drafter that looks up the context can propose. A loop over a line of the prompt counts whole."""
    if len(output) < n:
        return 0.0
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i:i + n]) in grams:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(output)


def copied_in_order_fraction(prompt: Sequence[int], output: Sequence[int]) -> float:
    """The share of output tokens matched, in order, to the prompt's (difflib's matching blocks): the answer's copy
    of its input, each prompt token counted at most once, so that a loop over one line is not taken for a copy."""
    blocks = difflib.SequenceMatcher(None, list(prompt), list(output), autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks) / max(len(output), 1)
