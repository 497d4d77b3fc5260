"""The Ollama API through the official `ollama` client (unchanged but its host and headers),
against the real server: gemma-3-270m for chat, generate, the model listings and structured
output, a tiny qwen3 with Qwen's tool template for tools. Greedy text equals chat completions'
for the same conversation; bad input gets Ollama's `{"error": ...}` with a 4xx, never a 500.
The parser and the writer also have fast tests of their own, without a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from serving_checks import serving_in_thread
from test_responses_api import THOUGHT
from tiny_models import write_tiny_model
from waiting import until
from word_tokens import word_tokens

from kafila.api.asks import ChatAsk, TextAsk
from kafila.api.errors import ApiError
from kafila.api.front import ApiConfig
from kafila.api.ollama_replies import NDJSON, OllamaWriter
from kafila.api.ollama_routes import ollama_name, served_id
from kafila.api.ollama_schemas import ChatBody, GenerateBody, Message, Options, conversation
from kafila.api.reasoning import ThinkReader
from kafila.api.requests import prepare_chat
from kafila.api.tool_calls import ToolCallStream
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta
from kafila.serving.chat_template import ChatTemplate, ReplySyntax
from kafila.serving.engine_loop import EngineLoop
from kafila.session.availability import Availability

GEMMA = "gemma-3-270m-q4_k_m"
KEY = "ollama-test-key"
CONTEXT = 1024
TOOLS_CONTEXT = 2048
FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_TEMPLATE = (FIXTURES / "Qwen-Qwen3-0.6B.jinja").read_text()  # tools, and reasoning in <think>
CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a colour of the sky."},
]


# --- the parser and the writer, without a model ----------------------------------------------------


def test_the_served_model_answers_to_its_id_and_its_ollama_name_only() -> None:
    config = ApiConfig(model_id=GEMMA, context_per_sequence=CONTEXT)
    assert ollama_name(GEMMA) == f"{GEMMA}:latest"
    assert ollama_name("qwen3:0.6b") == "qwen3:0.6b"  # an id with a tag keeps it
    assert served_id(GEMMA, config) == served_id(f"{GEMMA}:latest", config) == GEMMA
    for other in (f"{GEMMA}:7b", "llama3", f"{GEMMA}:latest:latest"):
        with pytest.raises(ApiError) as refused:
            served_id(other, config)
        assert refused.value.status == 404 and f"{GEMMA}:latest" in refused.value.message


def test_options_map_to_the_sampler_with_ollamas_defaults() -> None:
    default = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    generation = default.ask(CONTEXT).generation
    assert generation.limit is None and generation.stops == () and generation.alternatives is None
    sampling = generation.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repeat_penalty) == (0.8, 40, 0.9, 1.0)
    options = {
        "num_predict": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 2**32 + 5, "stop": ["a", "b"],
        "repeat_penalty": 1.2, "repeat_last_n": -1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "num_ctx": CONTEXT, "num_gpu": 99, "num_thread": 4, "use_mmap": True, "made_up": "ignored",
        "min_p": 0.0, "typical_p": 1.0, "mirostat": 0,
    }  # fmt: skip
    body = GenerateBody.model_validate({"model": "m", "prompt": "x", "options": options})
    generation = body.ask(CONTEXT).generation
    sampling = generation.sampling
    assert generation.limit == 7 and generation.stops == ("a", "b")
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0, 0.5, 3, 5)
    assert (sampling.repeat_penalty, sampling.repeat_last_n) == (1.2, CONTEXT)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    for no_limit in (0, -1, -2):  # Ollama's "to the end"
        assert Options(num_predict=no_limit).generation(CONTEXT, None).limit is None
    assert Options(stop="x").generation(CONTEXT, None).stops == ("x",)
    logprobs = ChatBody.model_validate({"model": "m", "logprobs": True, "top_logprobs": 3})
    assert logprobs.alternatives() == 3


def test_num_ctx_past_the_context_and_samplers_this_server_lacks_are_refused() -> None:
    body = ChatBody.model_validate({"model": "m", "messages": [], "options": {"num_ctx": CONTEXT + 1}})
    with pytest.raises(ApiError) as refused:
        body.ask(CONTEXT)
    assert refused.value.status == 400 and f"context of {CONTEXT} tokens" in refused.value.message
    for option in ({"min_p": 0.05}, {"typical_p": 0.5}, {"mirostat": 2}, {"temperature": "hot"}, {"top_k": 1.5}):
        with pytest.raises(ValueError):
            Options.model_validate(option)


def test_format_json_or_a_schema_becomes_the_output_format() -> None:
    def output(form: Any) -> Any:
        return GenerateBody.model_validate({"model": "m", "prompt": "x", "format": form}).ask(CONTEXT).output

    assert output(None).kind == output("").kind == "text"
    assert output("json").kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert (output(schema).kind, output(schema).schema) == ("json_schema", schema)
    with pytest.raises(ValueError, match="JSON schema"):
        output("yaml")


def test_generate_renders_system_and_prompt_as_a_conversation_unless_raw() -> None:
    ask = GenerateBody.model_validate({"model": "m", "prompt": "hi", "system": "be kind"}).ask(CONTEXT)
    assert isinstance(ask, ChatAsk)
    assert [(t.role, t.content) for t in ask.turns] == [("system", "be kind"), ("user", "hi")]
    raw = GenerateBody.model_validate({"model": "m", "prompt": "<s>hi", "raw": True}).ask(CONTEXT)
    assert isinstance(raw, TextAsk) and raw.prompt == "<s>hi"
    for refused in ({"template": "{{ .Prompt }}"}, {"context": [1, 2]}, {"suffix": "end"}, {"images": ["aGk="]}):
        with pytest.raises(ValueError):
            GenerateBody.model_validate({"model": "m", "prompt": "x", **refused})
    assert GenerateBody.model_validate({"model": "m", "prompt": "x", "template": "", "context": []})


def test_tool_results_answer_the_calls_an_assistant_turn_made() -> None:
    messages = [
        Message(role="user", content="weather and time?"),
        Message.model_validate(
            {
                "role": "assistant",
                "content": "",
                "thinking": "two calls",
                "tool_calls": [
                    {"function": {"name": "get_time", "arguments": {"zone": "UTC"}}},
                    {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                ],
            }
        ),
        Message(role="tool", content="sun", tool_name="get_weather"),
        Message(role="tool", content="noon"),  # no name: the first call not yet answered
    ]
    turns = conversation(messages, {"get_time", "get_weather"})
    calls = turns[1].calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert turns[1].reasoning == "two calls" and len({c.id for c in calls}) == 2
    assert (turns[2].call_id, turns[2].name) == (calls[1].id, "get_weather")
    assert (turns[3].call_id, turns[3].name) == (calls[0].id, "get_time")
    with pytest.raises(ApiError, match="names neither a tool offered"):
        conversation([*messages[:2], Message(role="tool", content="?", tool_name="launch")], {"get_time"})
    with pytest.raises(ApiError, match="answers no earlier tool call"):
        conversation([*messages[:2], Message(role="tool", content="?", tool_call_id="call_x")], set())


def test_think_reaches_the_template_where_it_can_be_told() -> None:
    qwen3 = ChatTemplate(QWEN3_TEMPLATE, "", "<|im_end|>", "qwen3")
    harmony = ChatTemplate((FIXTURES / "openai-gpt-oss-120b.jinja").read_text(), "", "", "gpt-oss")

    def prompt(template: ChatTemplate, think: Any) -> str:
        body = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "think": think})
        return prepare_chat(body.ask(CONTEXT), template).text

    assert prompt(qwen3, False).endswith("<think>\n\n</think>\n\n")  # Qwen 3's way to answer at once
    assert not prompt(qwen3, True).endswith("</think>\n\n") and prompt(qwen3, True) == prompt(qwen3, None)
    assert "Reasoning: high" in prompt(harmony, "high") and "Reasoning: medium" in prompt(harmony, None)


def _lines(chunks: list[bytes]) -> list[dict[str, Any]]:
    text = b"".join(chunks).decode()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_the_stream_writes_thinking_content_and_a_last_line_with_ollamas_counters() -> None:
    writer = OllamaWriter("chat-1", "m:latest", True, ThinkReader(None, opened=False))
    assert writer.media_type == NDJSON and writer.opening() == []
    out: list[bytes] = []
    for piece in ("<think>", "let me", " see</think>\n\n", "Blue", " sky"):
        out += writer.delta(TextDelta("chat-1", piece))
    out += writer.end(Finished("chat-1", FinishReason.STOP, prompt_tokens=12, completion_tokens=6))
    lines = _lines(out)
    assert "".join(line["message"].get("thinking", "") for line in lines) == "let me see"
    assert "".join(line["message"]["content"] for line in lines) == "Blue sky"
    assert all(line["model"] == "m:latest" and line["message"]["role"] == "assistant" for line in lines)
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    last = lines[-1]
    assert last["done_reason"] == "stop" and (last["prompt_eval_count"], last["eval_count"]) == (12, 6)
    assert last["total_duration"] == last["prompt_eval_duration"] + last["eval_duration"] > 0

    hidden = OllamaWriter("chat-2", "m", True, ThinkReader(None, opened=True), show_thinking=False)
    whole = hidden.whole("hmm</think>Red", Finished("chat-2", FinishReason.LENGTH, 3, 4), ())
    assert whole["message"] == {"role": "assistant", "content": "Red"} and whole["done_reason"] == "length"
    assert whole["done"] is True and whole["eval_count"] == 4


def test_tool_calls_go_out_whole_with_their_arguments_as_objects() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    text = f"Checking.{call}\n{call.replace('UTC', 'CET')}"
    writer = OllamaWriter("chat-3", "m", True, ToolCallStream(ReplySyntax.HERMES, parallel=True))
    out: list[bytes] = []
    for i in range(0, len(text), 3):
        out += writer.delta(TextDelta("chat-3", text[i : i + 3]))
    out += writer.end(Finished("chat-3", FinishReason.STOP, 5, 40))
    lines = _lines(out)
    calls = [call for line in lines for call in line["message"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls] == [{"zone": "UTC"}, {"zone": "CET"}]
    assert [c["function"]["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert all(len(line["message"].get("tool_calls", [])) <= 1 for line in lines)
    assert "".join(line["message"]["content"] for line in lines) == "Checking."
    assert lines[-1]["done_reason"] == "stop"

    whole = OllamaWriter("chat-4", "m", True, ToolCallStream(ReplySyntax.HERMES, parallel=True))
    reply = whole.whole(text, Finished("chat-4", FinishReason.STOP, 5, 40), ())
    assert [c["function"]["arguments"] for c in reply["message"]["tool_calls"]] == [{"zone": "UTC"}, {"zone": "CET"}]
    cut = whole.whole(call[:-20], Finished("chat-4", FinishReason.LENGTH, 5, 40), ())  # the limit cut the call
    assert "tool_calls" not in cut["message"] and cut["done_reason"] == "length"


def test_log_probabilities_cover_every_generated_token_thinkings_and_calls_too() -> None:
    """Ollama's server gives each line the log probabilities of the tokens it read for it before
    its parser splits them into `content`, `thinking` and `tool_calls` (a line of their own while
    the parser holds text back) and the whole reply all of them: every generated token, markers
    included, unlike chat completions' and the Responses API's, whose content carries only its own.
    Each delta's tokens ride on the first line it makes, or on one of their own."""
    texts, tokens = word_tokens(THOUGHT)

    def chat_writer() -> OllamaWriter:
        reader = ThinkReader(ToolCallStream(ReplySyntax.HERMES, True), False)
        return OllamaWriter("chat-5", "m", True, reader, show_thinking=True, logprobs=True)

    def logprobs_of(tokens: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs or ()]) for t in tokens]

    expected = [(t.piece.decode(), t.logprob, [(a.piece.decode(), a.logprob) for a in t.top]) for t in tokens]
    written, out, deltas = chat_writer(), list[bytes](), 0
    for start in range(0, len(tokens), 2):
        made = written.delta(TextDelta("chat-5", "".join(texts[start : start + 2]), tuple(tokens[start : start + 2])))
        deltas += 1
        assert made and ollama.ChatResponse.model_validate_json(made[0]).logprobs  # on the first line it made
        out += made
    out += written.end(Finished("chat-5", FinishReason.STOP, 30, len(tokens)))
    lines = [ollama.ChatResponse.model_validate(line) for line in _lines(out)]
    assert "".join(line.message.thinking or "" for line in lines) == "Look it up."
    assert "".join(line.message.content or "" for line in lines).strip() == "Sure."
    assert [c.function.name for line in lines for c in line.message.tool_calls or ()] == ["get_time"]
    assert sum(1 for line in lines if line.logprobs) == deltas
    streamed = logprobs_of(t for line in lines for t in line.logprobs or ())
    assert streamed == expected  # the thinking's, the markers', the text's and the call's
    whole = ollama.ChatResponse.model_validate(
        chat_writer().whole(THOUGHT, Finished("chat-5", FinishReason.STOP, 30, len(tokens)), tokens)
    )
    assert whole.message.thinking == "Look it up." and whole.message.tool_calls
    assert logprobs_of(whole.logprobs or ()) == expected


def test_generate_s_shape_and_a_failure_mid_stream_as_a_last_error_line() -> None:
    writer = OllamaWriter("gen-1", "m", False, None)
    lines = _lines(
        writer.delta(TextDelta("gen-1", "Once"))
        + writer.delta(TextDelta("gen-1", " upon"))
        + writer.failed(RequestFailed("gen-1", "the ring broke"))
    )
    assert [line.get("response") for line in lines] == ["Once", " upon", None]
    assert lines[-1] == {"error": "the ring broke"}
    whole = OllamaWriter("gen-2", "m", False, None).whole("Once", Finished("gen-2", FinishReason.STOP, 2, 1), ())
    assert whole["response"] == "Once" and "message" not in whole and whole["done"] is True


# --- through the official client, against the real server ------------------------------------------


@dataclass
class Served:
    url: str  # no key
    keyed_url: str  # the same session behind --api-key
    serving: Availability

    def client(self, **kwargs: Any) -> ollama.Client:
        return ollama.Client(host=self.url, timeout=120, **kwargs)


@contextmanager
def served(model: Path, architecture: str, model_id: str, context: int) -> Iterator[Served]:
    """The model behind its engine loop and two apps over the one session, as `kafila host`
    serves it: one open, one with an API key."""
    settings = ContextSettings(n_ctx=context * 2, n_batch=256, n_seq_max=2, n_threads=1)
    engine = open_engine(model, [1], settings)
    loop = EngineLoop(engine, concurrency=2, batch_rows=settings.n_batch, context_per_sequence=context)
    loop.start()
    serving = Availability()
    serving.become_ready(engine, loop, architecture)
    try:
        with ExitStack() as apps:
            urls = [
                apps.enter_context(
                    serving_in_thread(serving, context, ApiConfig(model_id, context_per_sequence=context, api_key=key))
                )
                for key in (None, KEY)
            ]
            yield Served(urls[0], urls[1], serving)
    finally:
        loop.stop()
        engine.close()


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Iterator[Served]:
    with served(gemma_path, "gemma3", GEMMA, CONTEXT) as running:
        yield running


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A tiny random qwen3 with Qwen 3's template (tools, and thinking); `<tool_call>` is one
    token of its vocabulary, so that the model, free to call or not, calls now and then."""
    path = write_tiny_model(
        tmp_path_factory.mktemp("ollama") / "qwen.gguf", "qwen3", n_blocks=2, chat_template=QWEN3_TEMPLATE,
        extra_specials=("<tool_call>", "</tool_call>"),
    )  # fmt: skip
    with served(path, "qwen3", "tiny-qwen", TOOLS_CONTEXT) as running:
        yield running


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The tiny random qwen3 with Qwen 3's template opening `<think>` for the model, as QwQ's and
    DeepSeek-R1's do: what it writes is thinking until it writes `</think>`."""
    opening = "{{- '<|im_start|>assistant\\n' }}"
    assert QWEN3_TEMPLATE.count(opening) == 1
    template = QWEN3_TEMPLATE.replace(opening, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    path = tmp_path_factory.mktemp("ollama") / "thinker.gguf"
    write_tiny_model(path, "qwen3", n_blocks=2, chat_template=template)
    with served(path, "qwen3", "tiny-thinker", TOOLS_CONTEXT) as running:
        yield running


def test_list_show_ps_and_version_describe_the_served_model(gemma: Served) -> None:
    client = gemma.client()
    listed = client.list().models
    assert [m.model for m in listed] == [f"{GEMMA}:latest"]
    assert listed[0].details is not None and listed[0].details.family == "gemma3"
    shown = client.show(f"{GEMMA}:latest")
    assert shown.capabilities == ["completion"]  # no tools in its (built-in) template, no thinking
    assert shown.modelinfo is not None and shown.modelinfo["gemma3.context_length"] == CONTEXT
    assert client.show(GEMMA).capabilities == ["completion"]
    running = client.ps().models
    assert [m.model for m in running] == [f"{GEMMA}:latest"] and running[0].context_length == CONTEXT
    version = httpx.get(f"{gemma.url}/api/version").json()
    assert version["version"].count(".") == 2
    assert httpx.head(f"{gemma.url}/").status_code == 200  # the Ollama CLI's check that a server is there
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("llama3")
    assert missing.value.status_code == 404 and f"{GEMMA}:latest" in missing.value.error


def test_greedy_chat_and_generate_equal_chat_completions(gemma: Served) -> None:
    client = gemma.client()
    openai_client = openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="unused", max_retries=0)
    expected = openai_client.chat.completions.create(
        model=GEMMA, messages=CONVERSATION, max_tokens=16, temperature=0,  # type: ignore[arg-type]
    ).choices[0].message.content  # fmt: skip
    assert expected
    options = {"temperature": 0, "num_predict": 16}
    whole = client.chat(f"{GEMMA}:latest", CONVERSATION, options=options)
    assert whole.message.content == expected and whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count and whole.eval_count <= 16 and whole.prompt_eval_count and whole.prompt_eval_count > 10
    parts = list(client.chat(GEMMA, CONVERSATION, options=options, stream=True))
    assert "".join(p.message.content or "" for p in parts) == expected
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert (last.done_reason, last.eval_count, last.prompt_eval_count) == (
        whole.done_reason, whole.eval_count, whole.prompt_eval_count,
    )  # fmt: skip
    assert last.eval_duration and last.prompt_eval_duration and last.total_duration
    assert last.total_duration >= last.eval_duration + last.prompt_eval_duration

    system, user = CONVERSATION[0]["content"], CONVERSATION[1]["content"]
    generated = client.generate(GEMMA, user, system=system, options=options)
    assert generated.response == expected and generated.done
    streamed = "".join(
        p.response or "" for p in client.generate(GEMMA, user, system=system, options=options, stream=True)
    )
    assert streamed == expected
    completion = openai_client.completions.create(model=GEMMA, prompt="The sky is", max_tokens=12, temperature=0)
    raw = client.generate(GEMMA, "The sky is", raw=True, options={"temperature": 0, "num_predict": 12})
    assert raw.response == completion.choices[0].text and raw.done_reason == "length" and raw.eval_count == 12


def test_log_probabilities_whole_and_streamed(gemma: Served) -> None:
    client = gemma.client()
    options = {"temperature": 0, "num_predict": 8}
    whole = client.chat(GEMMA, CONVERSATION, options=options, logprobs=True, top_logprobs=2)
    tokens = whole.logprobs or []
    assert len(tokens) == whole.eval_count and all(len(t.top_logprobs or ()) == 2 for t in tokens)
    assert "".join(t.token for t in tokens) == whole.message.content
    assert all(t.logprob <= 0 and t.top_logprobs and t.logprob == t.top_logprobs[0].logprob for t in tokens)
    parts = list(client.chat(GEMMA, CONVERSATION, options=options, logprobs=True, stream=True))
    streamed = [t for part in parts for t in part.logprobs or ()]
    assert [t.token for t in streamed] == [t.token for t in tokens]
    assert "logprobs" not in client.chat(GEMMA, CONVERSATION, options=options).model_dump(exclude_none=True)


def test_log_probabilities_cover_the_thinking_as_ollamas_do(thinker: Served) -> None:
    """A reply that is all thinking (the template opened it; the random model does not close it in
    12 tokens) carries a log probability for each generated token, as Ollama's server does, where
    chat completions' content would carry none; streamed the same tokens (to 1e-4). The prompt is
    computed once first, so that both requests reuse it from the cache (a prompt computed whole
    and one after a cached prefix differ by up to 0.03 in a log probability on a random model)."""
    client = thinker.client()
    ask = [{"role": "user", "content": "Why?"}]
    client.chat("tiny-thinker", ask, think=True, options={"num_predict": 1})
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat("tiny-thinker", ask, think=True, options=options, logprobs=True, top_logprobs=2)
    assert whole.message.thinking and not whole.message.content and whole.done_reason == "length"
    tokens = whole.logprobs or []
    assert len(tokens) == whole.eval_count == 12 and all(len(t.top_logprobs or ()) == 2 for t in tokens)
    assert "".join(t.token for t in tokens) == whole.message.thinking
    parts = list(client.chat("tiny-thinker", ask, think=True, options=options, logprobs=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    streamed = [t for part in parts for t in part.logprobs or ()]
    assert [t.token for t in streamed] == [t.token for t in tokens]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in tokens], abs=1e-4)


def test_stop_strings_seed_and_a_load_request(gemma: Served) -> None:
    client = gemma.client()
    free = client.generate(GEMMA, "One, two, three,", raw=True, options={"temperature": 0, "num_predict": 12}).response
    assert free
    stop = free.strip()[:2] if len(free.strip()) > 2 else free
    cut = client.generate(
        GEMMA, "One, two, three,", raw=True, options={"temperature": 0, "num_predict": 12, "stop": [stop]}
    )
    assert cut.response == free[: free.index(stop)] and cut.done_reason == "stop"
    seeded = {"temperature": 1.0, "seed": 42, "num_predict": 10}
    first = client.chat(GEMMA, CONVERSATION, options=seeded).message.content
    assert client.chat(GEMMA, CONVERSATION, options=seeded).message.content == first
    # With nothing to generate, a client asks Ollama to load the model; it is loaded.
    loaded = client.chat(GEMMA, [])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    assert client.generate(GEMMA, keep_alive=0).done_reason == "unload"


def test_format_with_a_schema_gives_json_that_validates(gemma: Served) -> None:
    schema = {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "enum": ["blue", "grey", "red"]},
            "clouds": {"type": "integer", "minimum": 0, "maximum": 9},
            "night": {"type": "boolean"},
        },
        "required": ["colour", "clouds", "night"],
    }
    client = gemma.client()
    reply = client.chat(GEMMA, CONVERSATION, format=schema, options={"temperature": 0, "num_predict": 64})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content or ""), schema)
    streamed = "".join(
        p.message.content or ""
        for p in client.chat(GEMMA, CONVERSATION, format=schema, stream=True, options={"seed": 3})
    )
    jsonschema.validate(json.loads(streamed), schema)
    anything = client.generate(
        GEMMA, "A JSON object about the sky:", format="json", options={"num_predict": 96, "seed": 1}
    )
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.response or ""), dict)


def test_the_api_key_guards_the_ollama_api(gemma: Served) -> None:
    keyed = ollama.Client(host=gemma.keyed_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert [m.model for m in keyed.list().models] == [f"{GEMMA}:latest"]
    assert keyed.generate(GEMMA, "Hi", options={"num_predict": 2}).done
    for client in (
        ollama.Client(host=gemma.keyed_url),
        ollama.Client(host=gemma.keyed_url, headers={"Authorization": "Bearer nope"}),
    ):
        for call in (
            client.list,
            client.ps,
            lambda c=client: c.chat(GEMMA, CONVERSATION),
            lambda c=client: c.show(GEMMA),
        ):
            with pytest.raises(ollama.ResponseError) as refused:
                call()
            assert refused.value.status_code == 401 and "API key" in refused.value.error
    assert httpx.get(f"{gemma.keyed_url}/api/version").status_code == 200  # a health check, as /health


def _post(url: str, path: str, body: Any, content_type: str = "application/json") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": content_type}, timeout=60)


USER = [{"role": "user", "content": "x"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": GEMMA, "messages": USER, **fields}


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}
BAD = [
    ("/api/chat", {"messages": USER}, 400, "model"),  # no model
    ("/api/chat", chat(messages="hello"), 400, "messages"),
    ("/api/chat", chat(messages=[{"content": "x"}]), 400, "role"),
    ("/api/chat", chat(messages=[{"role": "narrator", "content": "x"}]), 400, "role"),
    ("/api/chat", chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("/api/chat", chat(messages=[{"role": "user", "content": "x", "images": ["aGk="]}]), 400, "images"),
    ("/api/chat", chat(stream="yes"), 400, "stream"),
    ("/api/chat", chat(options={"temperature": "hot"}), 400, "temperature"),
    ("/api/chat", chat(options={"num_ctx": 10**6}), 400, "num_ctx"),
    ("/api/chat", chat(options="hot"), 400, "options"),
    ("/api/chat", chat(format="yaml"), 400, "format"),
    ("/api/chat", chat(think=True), 400, "thinking"),
    ("/api/chat", chat(messages=[{"role": "tool", "content": "x", "tool_name": "nope"}]), 400, "nope"),
    ("/api/chat", chat(tools=[{"function": {}}]), 400, "name"),
    ("/api/chat", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool"),
    ("/api/chat", {"model": "llama3", "messages": USER}, 404, "not found"),
    ("/api/generate", {"model": GEMMA, "prompt": 5}, 400, "prompt"),
    ("/api/generate", {"model": GEMMA, "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"model": GEMMA, "prompt": "x", "context": [1, 2, 3]}, 400, "context"),
    ("/api/generate", {"model": GEMMA, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"model": GEMMA, "prompt": "x", "options": {"num_predict": CONTEXT * 4}}, 400, "context length"),
    ("/api/generate", {"model": GEMMA, "prompt": "x", "format": BAD_SCHEMA}, 400, ""),
    ("/api/show", {}, 400, "model"),
    ("/api/show", {"model": "llama3"}, 404, "not found"),
    ("/api/pull", {"model": GEMMA}, 404, "/api/chat"),  # not served: says what is
    ("/api/chat", b"{not json", 400, "JSON"),
    ("/api/chat", b"[1, 2]", 400, "object"),
]


@pytest.mark.parametrize(("path", "body", "status", "says"), BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_ollamas_error_shape_and_never_a_500(
    gemma: Served, path: str, body: Any, status: int, says: str
) -> None:
    response = _post(gemma.url, path, body)
    assert response.status_code == status, response.text
    error = response.json()
    assert list(error) == ["error"] and isinstance(error["error"], str) and error["error"]
    assert says.lower() in error["error"].lower(), error


def test_a_form_posted_body_is_refused_in_ollamas_shape(gemma: Served) -> None:
    """curl's `-d` sends a form; a browser page may too without asking first (see guards)."""
    response = _post(gemma.url, "/api/chat", {"model": GEMMA}, "application/x-www-form-urlencoded")
    assert response.status_code == 415 and "Content-Type: application/json" in response.json()["error"]
    with pytest.raises(ollama.ResponseError) as refused:  # and through the client, as its users meet it
        gemma.client().chat(GEMMA, [{"role": "user", "content": "x"}], options={"temperature": "hot"})
    assert refused.value.status_code == 400 and "temperature" in refused.value.error


def test_an_abandoned_stream_frees_its_slot(gemma: Served) -> None:
    ring = gemma.serving.ring
    assert ring is not None
    body = {"model": GEMMA, "messages": CONVERSATION, "options": {"num_predict": CONTEXT // 2, "temperature": 1.0}}
    with httpx.stream("POST", f"{gemma.url}/api/chat", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith(NDJSON)
        first = json.loads(next(response.iter_lines()))
        assert first["done"] is False
    until(lambda: ring.running == 0 and ring.queued == 0, "the abandoned request to leave the engine")
    after = gemma.client().chat(GEMMA, CONVERSATION, options={"num_predict": 3})
    assert after.done and after.eval_count == 3


def test_tools_a_call_and_its_result_round_trip(qwen: Served) -> None:
    client = qwen.client()
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    }
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    shown = client.show("tiny-qwen:latest")
    assert shown.capabilities == ["completion", "tools", "thinking"]
    bare = client.chat("tiny-qwen", ask, options={"num_predict": 1})
    offered = client.chat("tiny-qwen", ask, tools=[weather], options={"num_predict": 1})
    assert offered.prompt_eval_count and bare.prompt_eval_count and offered.prompt_eval_count > bare.prompt_eval_count
    # Free to call or not, the random model calls now and then (one seed in ten or so, drawing from
    # its whole vocabulary): the first seed with which it does.
    options: dict[str, Any] = {"num_predict": 120, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    reply = None
    for seed in range(100):
        candidate = client.chat("tiny-qwen", ask, tools=[weather], options={**options, "seed": seed})
        if candidate.message.tool_calls and candidate.done_reason == "stop":
            reply, options["seed"] = candidate, seed
            break
    assert reply is not None and reply.message.tool_calls, "no seed of 100 made a call"
    call = reply.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), weather["function"]["parameters"])  # type: ignore[index]
    streamed = [
        c
        for part in client.chat("tiny-qwen", ask, tools=[weather], options=options, stream=True)
        for c in part.message.tool_calls or []
    ]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        (c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls
    ]
    result = {"role": "tool", "content": '{"forecast": "sun"}', "tool_name": "get_weather"}
    answer = client.chat("tiny-qwen", [*ask, reply.message, result], tools=[weather], options={"num_predict": 4})
    assert answer.done and answer.prompt_eval_count and answer.prompt_eval_count > (offered.prompt_eval_count or 0)
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat("tiny-qwen", [*ask, reply.message, {**result, "tool_name": "get_time"}], tools=[weather])
    assert refused.value.status_code == 400 and "get_time" in refused.value.error


def test_think_on_a_thinking_model(qwen: Served) -> None:
    client = qwen.client()
    ask = [{"role": "user", "content": "Why?"}]
    thinking = client.chat("tiny-qwen", ask, think=True, options={"num_predict": 1})
    direct = client.chat("tiny-qwen", ask, think=False, options={"num_predict": 1})
    assert thinking.done and direct.done and direct.message.thinking is None
    assert thinking.prompt_eval_count and direct.prompt_eval_count
    assert direct.prompt_eval_count > thinking.prompt_eval_count  # the template closed an empty <think>
    generated = client.generate("tiny-qwen", "Why?", think=False, options={"num_predict": 1})
    assert generated.prompt_eval_count == direct.prompt_eval_count
