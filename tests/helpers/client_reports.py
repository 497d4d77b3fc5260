"""What the Python agent frameworks' drivers saw, as types both sides read: each driver runs in
its framework's own virtual environment (`.clients/`, which `.ci/python-clients` makes), prints
one of these as JSON on its last line, and the test (tests/test_python_agent_clients.py) reads it
back. Only pydantic here, which every framework brings."""

from __future__ import annotations

from pydantic import BaseModel, JsonValue


class CallSeen(BaseModel):
    """A tool call as the framework read it from the model's reply."""

    call_id: str
    name: str
    arguments: dict[str, JsonValue]


class OutputSent(BaseModel):
    """A tool's output as the framework sent it back to the model on a later request."""

    call_id: str
    output: str


class Turn(BaseModel):
    """One request to the model: the tool outputs it carried and the calls its reply made."""

    outputs_sent: list[OutputSent]
    calls: list[CallSeen]


class AgentRun(BaseModel):
    """An agent run that stopped after its second request (the tiny tool caller calls forever):
    its requests in order, what the tool function was called with and what it returned, and how
    the framework said it stopped."""

    turns: list[Turn]
    tool_received: list[dict[str, JsonValue]]
    tool_returned: list[str]
    stopped_by: str
    top_logprobs: list[int | None] = []  # as each stored response says (Responses model kinds)


class StructuredAnswer(BaseModel):
    """An answer the framework parsed into the pydantic model it was asked for."""

    type_name: str
    fields: dict[str, JsonValue]


class ChatTexts(BaseModel):
    """A chat model's greedy text, whole and streamed (with the count of chunks that carried text)."""

    invoked: str
    streamed: str
    text_chunks: int


def weather_report(city: str) -> str:
    """The tool's return, which a driver checks reaches the model's next request."""
    return f"Rain in {city!r}, 12 C."
