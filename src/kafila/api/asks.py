"""What a request asks of the model, whatever dialect it came in: each dialect's parser (OpenAI's
chat and completions in `schemas`) validates its own body and gives one of these, and
`requests` prepares it for the engine the same way for all of them.

Pure data: nothing here knows a wire format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kafila.api.tool_calls import ToolSpec
from kafila.runtime.engine.sampling import SamplingSettings

Role = Literal["system", "user", "assistant", "tool"]


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    """A body's `stop` (none, one string, or several: OpenAI's and Ollama's shape) as a Generation holds it."""
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


@dataclass(frozen=True)
class CallMade:
    """A tool call an earlier assistant turn made, sent back with the conversation."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def for_template(self) -> dict[str, Any]:
        """Arguments as an object, as transformers and llama.cpp hand them to templates (Qwen's
        writes them with `tojson`); kept as text where they are not a JSON object."""
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        if not isinstance(arguments, dict):
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class Turn:
    """One message of the conversation, as chat templates read it."""

    role: Role
    content: str = ""
    calls: tuple[CallMade, ...] = ()  # an assistant turn's tool calls
    call_id: str | None = None  # a tool result's: the call it answers
    name: str | None = None  # a tool result's: the tool that gave it
    reasoning: str | None = None  # what an assistant turn reasoned before it answered

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.calls:
            message["tool_calls"] = [call.for_template() for call in self.calls]
        if self.call_id is not None:
            message["tool_call_id"] = self.call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        if self.reasoning and self.role == "assistant":
            # gpt-oss's template shows it before that turn's tool call, as "thinking"; Qwen 3's
            # reads `reasoning_content`.
            message["reasoning_content"] = message["thinking"] = self.reasoning
        return message


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: its name, what it does, and the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # None: it takes no arguments

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.parameters or {"type": "object", "properties": {}})

    def for_template(self) -> dict[str, Any]:
        """As templates read it: OpenAI's shape, with a description always (gpt-oss's writes one
        for every tool)."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """Whether the model may call a tool ("auto"), must ("required"), or is not shown the tools
    ("none"); `name`: the one tool a call must be to."""

    mode: Literal["none", "auto", "required"]
    name: str | None = None


@dataclass(frozen=True)
class OutputFormat:
    """Free text, any JSON object, or JSON that `schema` accepts: the last two become a grammar."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None

    @property
    def constrained(self) -> bool:
        return self.kind != "text"


TEXT = OutputFormat()


@dataclass(frozen=True)
class Generation:
    """How to generate, whatever is generated: the token limit (None: to the end of the context),
    the sampler (its grammar is added once the request is prepared), stop strings, and how many
    alternatives per token to report log probabilities with (None: no log probabilities)."""

    limit: int | None
    sampling: SamplingSettings
    stops: tuple[str, ...] = ()
    alternatives: int | None = None


@dataclass(frozen=True)
class ChatAsk:
    """A conversation to answer, with the tools the model may call and the form of its answer."""

    turns: tuple[Turn, ...]
    generation: Generation
    tools: tuple[FunctionTool, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parallel_calls: bool = True
    output: OutputFormat = TEXT
    # Whether a thinking model reasons before it answers, where its template can be told
    # (Qwen 3's `enable_thinking`); None: as the template does by default.
    thinking: bool | None = None
    effort: Literal["low", "medium", "high"] | None = None  # how hard a model that takes one reasons (gpt-oss)

    def template_options(self) -> dict[str, Any]:
        """What the chat template is told beside the messages and tools (the names templates read)."""
        options: dict[str, Any] = {}
        if self.thinking is not None:
            options["enable_thinking"] = self.thinking
        if self.effort is not None:
            options["reasoning_effort"] = self.effort
        return options

    def calling_tools(self) -> bool:
        """Whether the model is shown the tools and its reply is read for calls."""
        return bool(self.tools) and self.choice.mode != "none"

    def forced_tools(self) -> tuple[FunctionTool, ...]:
        """The tools a call must be to, where one must be made ("required" or a named one); else none."""
        if self.choice.name is not None:
            return tuple(tool for tool in self.tools if tool.name == self.choice.name)
        return self.tools if self.choice.mode == "required" else ()


@dataclass(frozen=True)
class TextAsk:
    """A text to continue, as it is or as token ids already."""

    prompt: str | list[int]
    generation: Generation
    output: OutputFormat = TEXT
