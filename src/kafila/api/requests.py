"""Request preparation, pure: what a request asks (`asks`), whatever its dialect, made into what
the engine runs: the prompt, the grammar its tools or output format ask for, and the reader that
splits the reply the template writes (tool calls, reasoning, harmony channels)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kafila.api.asks import ChatAsk, Generation, OutputFormat, TextAsk
from kafila.api.errors import invalid
from kafila.api.harmony import HarmonyReader
from kafila.api.reasoning import ThinkReader
from kafila.api.structured import JSON_OBJECT_GRAMMAR_SCHEMA, SchemaRefused, schema_grammar
from kafila.api.tool_calls import (
    ReplyReader,
    ToolCallStream,
    mistral_id_of,
    single_call_only,
    tool_call_grammar,
)
from kafila.serving.chat_template import ChatTemplate, ReplySyntax, TemplateError


def grammar_of(ask: ChatAsk | TextAsk, syntax: ReplySyntax | None, parallel: bool, harmony: bool) -> str | None:
    """The grammar a request's output must follow: a forced tool call's; else the output
    format's (after a harmony model's final-channel header); else, with tools in "auto", free
    text or calls. Every tool's parameters are converted, used or not, so that a schema this
    server cannot follow is a 400 whatever the tool choice says."""
    calls = None
    if isinstance(ask, ChatAsk) and ask.tools:
        written = syntax or ReplySyntax.HERMES  # with tool choice "none" on a model without a syntax
        try:
            calls = tool_call_grammar(written, [t.spec() for t in ask.tools], parallel, forced=False)
            forced = ask.forced_tools()
            if forced:
                return tool_call_grammar(written, [t.spec() for t in forced], parallel, forced=True)
        except SchemaRefused as error:
            raise invalid(str(error), "tools") from None
    if not ask.output.constrained:
        return calls if isinstance(ask, ChatAsk) and ask.calling_tools() else None
    return output_grammar(ask.output, harmony)


def output_grammar(output: OutputFormat, harmony: bool) -> str:
    schema = output.schema if output.kind == "json_schema" and output.schema is not None else None
    try:
        return schema_grammar(
            JSON_OBJECT_GRAMMAR_SCHEMA if schema is None else schema, prefix=HARMONY_FINAL if harmony else ""
        )
    except SchemaRefused as error:
        raise invalid(str(error), "response_format") from None


HARMONY_FINAL = "<|channel|>final<|message|>"  # where a harmony reply's answer begins


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


@dataclass(frozen=True)
class PreparedChat:
    """A chat request as the engine takes it: its prompt's text (tokenized by the route, off the
    event loop where it is long), the grammar its tools or response format ask for, and the
    reader of the reply the template writes."""

    text: str
    add_bos: bool  # the template did not write the BOS itself
    grammar: str | None
    reader: ReplyReader | None


def prepare_chat(ask: ChatAsk, template: ChatTemplate) -> PreparedChat:
    """The prompt, grammar and reader of a chat request; an `ApiError` (400) for tools the
    template cannot write or messages it cannot render."""
    calling = ask.calling_tools()
    if calling and template.tool_syntax is None:
        raise invalid(
            "This model's chat template writes no tool-call syntax this server reads (Hermes/Qwen "
            "<tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS] or gpt-oss harmony); send tool_choice "
            "'none' or no tools.", "tools",
        )  # fmt: skip
    syntax = template.reply_syntax
    parallel = ask.parallel_calls and not (syntax and single_call_only(syntax))
    grammar = grammar_of(ask, template.tool_syntax, parallel, syntax is ReplySyntax.HARMONY)
    tools = [tool.for_template() for tool in ask.tools] if calling else None
    mistral = template.tool_syntax in (ReplySyntax.MISTRAL, ReplySyntax.MISTRAL_ARGS)
    try:
        turns = [turn.for_template() for turn in ask.turns]
        rendered = template.render(turns, tools, mistral_id_of if mistral else None, ask.template_options())
    except TemplateError as error:
        raise invalid(str(error), "messages") from None
    # A grammar from the first token: no reasoning first, even where the template opened it.
    held_from_the_start = bool(ask.forced_tools()) or ask.output.constrained
    offered = [tool.name for tool in ask.tools] if calling else None
    reader = reply_reader(template, offered, parallel, rendered.opens_thinking and not held_from_the_start)
    return PreparedChat(rendered.text, not rendered.starts_with_bos, grammar, reader)


@dataclass(frozen=True)
class PreparedCompletion:
    """A completion request as the engine takes it: its prompt as text (tokenized by the route)
    or as token ids already, and the grammar its response format asks for."""

    text: str | None
    tokens: list[int] | None
    grammar: str | None


def prepare_completion(ask: TextAsk, n_vocab: int) -> PreparedCompletion:
    """The prompt and grammar of a completion request; an `ApiError` (400) for token ids outside
    this model's vocabulary."""
    prompt = ask.prompt
    grammar = grammar_of(ask, None, False, False)
    if isinstance(prompt, str):
        return PreparedCompletion(prompt, None, grammar)
    if any(not 0 <= token < n_vocab for token in prompt):
        raise invalid(f"prompt token ids must be from 0 to {n_vocab - 1}, this model's vocabulary", "prompt")
    return PreparedCompletion(None, prompt, grammar)


@dataclass(frozen=True)
class ServeRequest:
    """A request ready for the engine, whatever its dialect: its prompt's token ids, how to
    generate, the grammar the output must follow, and whether the reply streams. `param`: the
    request's field that holds the prompt, for errors that refuse it."""

    prompt: list[int]
    param: str
    generation: Generation
    grammar: str | None = None
    stream: bool = False
