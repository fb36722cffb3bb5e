"""The Responses stream's item statuses against the whole response made of the same output (server/responses/
render.py): an answer cut off by max_output_tokens ends `incomplete` in both, with text and with none at all."""
from __future__ import annotations

import json

import pytest

from minisrv.server.generation import Choice
from minisrv.server.openai.protocol import UsageInfo
from minisrv.server.responses.render import ResponseRenderer
from minisrv.server.responses.routes import ResponsesRequest, echo_fields

USAGE = UsageInfo(prompt_tokens=5, completion_tokens=2, total_tokens=7)


def renderer() -> ResponseRenderer:
    return ResponseRenderer("m", echo_fields(ResponsesRequest(input="x")), lambda text: len(text.split()), None, None)


def streamed_response(pieces, finish_reason: str) -> dict:
    """The response of the stream's last event (response.completed), the output fed in `pieces`."""
    r, ch = renderer(), Choice(0, num_output_tokens=2)
    framed = r.opening(ch)
    for k, piece in enumerate(pieces):
        ch.text += piece
        framed += r.chunks(ch, piece, [], finish_reason if k == len(pieces) - 1 else None)
    events = [json.loads(line[len("data: "):]) for line in "".join(framed + r.closing(USAGE)).splitlines()
              if line.startswith("data: ")]
    return events[-1]["response"]


@pytest.mark.parametrize("finish_reason,status", [("length", "incomplete"), ("stop", "completed")])
@pytest.mark.parametrize("pieces", [[""], ["Once ", "upon"]])
def test_the_stream_ends_its_items_as_the_whole_response_does(pieces, finish_reason, status) -> None:
    streamed = streamed_response(pieces, finish_reason)
    whole = renderer().response([Choice(0, text="".join(pieces), finish_reason=finish_reason,
                                        num_output_tokens=2)], USAGE)
    assert streamed["status"] == whole["status"] == status
    assert [(o["type"], o["status"]) for o in streamed["output"]] == [(o["type"], o["status"]) for o in whole["output"]]
    assert streamed["output"][-1]["status"] == status
