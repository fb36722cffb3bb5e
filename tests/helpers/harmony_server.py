"""A gpt-oss server without the model: the HTTP app over a tokenizer made from openai-harmony's own encoding (in a
folder whose config.json says model_type gpt_oss, which is what picks the harmony format) and an engine that answers
every request with a scripted run of token ids, one output per token, as the engine streams them (a special token's
text is empty, as the detokenizer skips it). Used by test_harmony.py."""
from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace
from typing import Any, List, Sequence

from transformers.convert_slow_tokenizer import bytes_to_unicode

from minisrv.engine.request import RequestOutput, SamplingParams
from minisrv.server.app import create_app
from minisrv.server.messages import EngineInfo
from minisrv.server.plan.harmony import load_encoding
from minisrv.server.state import ServerState

BYTE_CHARS = bytes_to_unicode()
VOCAB = 201088  # gpt-oss's embedding rows


class HarmonyTokenizer:
    """What the server asks of a tokenizer, answered by the harmony encoding (gpt-oss's vocabulary)."""

    chat_template = None

    def __init__(self, folder: str) -> None:
        self.enc = load_encoding()
        self.name_or_path = folder

    def __call__(self, text: str, add_special_tokens: bool = False) -> Any:
        return SimpleNamespace(input_ids=self.enc.encode(text, allowed_special="all"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.enc.decode([t for t in ids if not (skip_special_tokens and self.enc.is_special_token(t))])

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        one = isinstance(ids, int)
        pieces = ["".join(BYTE_CHARS[b] for b in self.enc.decode([t]).encode()) for t in ([ids] if one else ids)]
        return pieces[0] if one else pieces


class ScriptedIds:
    """An engine client that answers every request with the same token ids, the last one ending it ("stop"), and
    keeps what it was sent."""

    ready, dead = True, False

    def __init__(self, tokenizer: HarmonyTokenizer, ids: List[int]) -> None:
        self.tok, self.ids = tokenizer, ids
        self.prompts: List[List[int]] = []
        self.params: List[SamplingParams] = []

    def submit(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, sink: asyncio.Queue,
               tag: Any) -> None:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        loop, offset = asyncio.get_running_loop(), 0
        for k, tid in enumerate(self.ids):
            last = k == len(self.ids) - 1
            text = self.tok.decode([tid], skip_special_tokens=True)
            out = RequestOutput(rid, [tid], text, [], [offset], last, "stop" if last else None,
                                num_output_tokens=k + 1)
            loop.call_later(0.001 * (k + 1), sink.put_nowait, (tag, out))
            offset += len(text)

    def abort(self, rid: str) -> None:
        pass


def gpt_oss_folder(folder: str) -> str:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}, f)
    return folder


def harmony_app(folder: str, completion: str) -> Any:
    """The app, and its engine client, answering with `completion` (harmony text, special tokens written out)."""
    tok = HarmonyTokenizer(gpt_oss_folder(folder))
    client = ScriptedIds(tok, tok.enc.encode(completion, allowed_special="all"))
    info = EngineInfo("gpt-oss", "torch", "cpu", 8192, 8192, VOCAB)
    return create_app(ServerState(client=client, tokenizer=tok, served_model_name="m", info=info)), client
