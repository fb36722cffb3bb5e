"""Tools for a model whose chat template ignores them (the default SmolLM2's among them: the model would never learn
of them). They and the call format go into a system prompt, as llama.cpp's server does, in the hermes format that
tools.py reads back."""
from __future__ import annotations

import json
from typing import Any, Dict, List

PROBE_MESSAGES = [{"role": "user", "content": "What is the weather?"}]
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool_name", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]

INSTRUCTIONS = ("You may call the functions below. To call one, answer with only\n"
                "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>\n"
                "(one block per call). Otherwise, answer normally.\n\nFunctions:\n")


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts the tools it is given into the prompt (a probe rendered with and
    without one tool). A template that fails on the probe counts as reading them: nothing is added then."""
    try:
        plain = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False,
                                                   tools=PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - no template, or one that needs other messages: leave tools to it
        return True
    return plain != with_tools


def with_tool_prompt(messages: List[Dict[str, Any]], tools: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages with the tools and the call format in the system prompt (added to the first system message, or
    a new one first)."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = INSTRUCTIONS + listing
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
