"""Request preparation, pure: the grammar a request's tools or response format ask for, and the
reader that splits the reply the template writes (tool calls, reasoning, harmony channels)."""

from __future__ import annotations

from collections.abc import Sequence

from kafila.api.errors import invalid
from kafila.api.harmony import HarmonyReader
from kafila.api.reasoning import ThinkReader
from kafila.api.schemas import ChatRequest, Tool
from kafila.api.schemas import Request as ApiRequest
from kafila.api.structured import JSON_OBJECT_GRAMMAR_SCHEMA, SchemaRefused, schema_grammar
from kafila.api.tool_calls import (
    ReplyReader,
    ToolCallStream,
    ToolSpec,
    tool_call_grammar,
)
from kafila.serving.chat_template import ChatTemplate, ReplySyntax


def grammar_of(body: ApiRequest, syntax: ReplySyntax | None, parallel: bool, harmony: bool) -> str | None:
    """The grammar a request's output must follow: a forced tool call's; else the response
    format's (after a harmony model's final-channel header); else, with tools in "auto", free
    text or calls. Every tool's parameters are converted, used or not, so that a schema this
    server cannot follow is a 400 whatever tool_choice says."""
    calls = None
    if isinstance(body, ChatRequest) and body.tools:
        written = syntax or ReplySyntax.HERMES  # with tool_choice "none" on a model without a syntax
        try:
            calls = tool_call_grammar(written, [tool_spec(t) for t in body.tools], parallel, forced=False)
            forced = body.forced_tools()
            if forced:
                return tool_call_grammar(written, [tool_spec(t) for t in forced], parallel, forced=True)
        except SchemaRefused as error:
            raise invalid(str(error), "tools") from None
    form = body.response_format
    if form is None or form.type == "text":
        return calls if isinstance(body, ChatRequest) and body.calling_tools() else None
    schema = form.json_schema.json_schema if form.json_schema is not None else None
    try:
        return schema_grammar(
            JSON_OBJECT_GRAMMAR_SCHEMA if form.type == "json_object" or schema is None else schema,
            prefix=HARMONY_FINAL if harmony else "",
        )
    except SchemaRefused as error:
        raise invalid(str(error), "response_format") from None


HARMONY_FINAL = "<|channel|>final<|message|>"  # where a harmony reply's answer begins


def tool_spec(tool: Tool) -> ToolSpec:
    return ToolSpec(tool.function.name, tool.function.schema_of_arguments())


def reply_reader(
    template: ChatTemplate, offered: Sequence[str] | None, parallel: bool, thinking: bool
) -> ReplyReader | None:
    """How a chat reply is read: a harmony model's always (its channels), a thinking model's for
    its reasoning, others' for calls to the `offered` tools (None: the request calls none);
    `thinking`: the reply starts inside its reasoning."""
    syntax = template.reply_syntax
    if syntax is ReplySyntax.HARMONY:
        return HarmonyReader(offered or (), parallel=parallel)
    answer = ToolCallStream(syntax, parallel) if offered is not None and syntax is not None else None
    return ThinkReader(answer, thinking) if template.thinks else answer
