"""The Ollama API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`): its bodies read into what they ask (`asks`), prepared as any dialect's are
(`requests`), and answered in Ollama's shape: JSON lines (`application/x-ndjson`) as the reply
comes by default, one JSON object with `stream: false`, errors as `{"error": "..."}`.

Model names: the served model answers to its Ollama name, the model id with the tag `:latest`
(`gemma-3-270m-q4_k_m:latest`; an id that has a tag of its own keeps it), and to the bare id;
any other name is a 404, as Ollama answers a model it has not pulled.

Sampling follows Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, no repeat penalty:
ollama/ollama#17679 dropped its old 1.1), a random seed unless `options.seed` sets one, and no
token limit unless `num_predict` sets one. Options Ollama knows that change how the model runs
on a machine (`num_gpu`, `num_thread`, `num_batch`, …) are ignored, as are unknown ones;
`num_ctx` past the session's context, and samplers this server does not have (`min_p`,
`typical_p`, `mirostat`) set to anything but their neutral value, are a 400. So are what this
server cannot honour: `images`, generate's `template`, `context` and `suffix`.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kafila.api.asks import TextAsk
from kafila.api.errors import ApiError, invalid
from kafila.api.front import ApiConfig, Front, new_id
from kafila.api.ollama_replies import OllamaWriter, loaded
from kafila.api.ollama_schemas import ChatBody, GenerateBody, ShowBody
from kafila.api.requests import ServeRequest, prepare_completion
from kafila.serving.chat_template import ReplySyntax
from kafila.serving.handle import ServingHandle

ROUTES = "POST /api/chat, POST /api/generate, GET /api/tags, POST /api/show, GET /api/ps, GET /api/version"
# The Ollama release whose API this follows: clients gate features on it (`think`, tool calls,
# structured output), so it names Ollama's version, not Kafila's.
OLLAMA_VERSION = "0.12.6"
# A model Ollama keeps loaded for ever says so with a far expiry; this one stays while the session serves.
LOADED_UNTIL = "2318-01-01T00:00:00Z"


# --- names -----------------------------------------------------------------------------------------


def ollama_name(model_id: str) -> str:
    """The served model's Ollama name: its id with the tag `:latest`, unless the id has a tag."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else f"{model_id}:latest"


def served_id(name: str, config: ApiConfig) -> str:
    """The served model's id, for its Ollama name or the id itself; a 404 for any other name."""
    if name in (config.model_id, ollama_name(config.model_id)):
        return config.model_id
    raise ApiError(
        404, f'model "{name[:256]}" not found; this server serves "{ollama_name(config.model_id)}"',
        "invalid_request_error", "model_not_found", "model",
    )  # fmt: skip


# --- routes ----------------------------------------------------------------------------------------


def error_body(error: ApiError) -> Response:
    """Ollama's error shape: the message alone."""
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers or None)


def install(app: FastAPI, front: Front) -> None:
    config = front.config
    front.error_shape("/api/", error_body)

    @app.get("/api/version")
    async def version() -> dict[str, Any]:
        """Open, as /health is: clients ask it to tell whether a server is there."""
        return {"version": OLLAMA_VERSION}

    async def here() -> Response:
        """`HEAD /` is how the Ollama CLI tells that a server is there (`GET /` is the web page)."""
        return Response(status_code=200)

    for path in ("/", "/api/version"):
        app.add_api_route(path, here, methods=["HEAD"], include_in_schema=False)

    @app.get("/api/tags")
    async def tags(request: Request) -> dict[str, Any]:
        front.authorise(request)
        return {"models": [model_entry(config, front.serving.ring)]}

    @app.get("/api/ps")
    async def ps(request: Request) -> dict[str, Any]:
        """The model is loaded while a ring serves it."""
        front.authorise(request)
        ring = front.serving.ring
        if ring is None or ring.error is not None:
            return {"models": []}
        entry = model_entry(config, ring)
        del entry["modified_at"]
        loaded_entry = {
            **entry,
            "expires_at": LOADED_UNTIL,
            "size_vram": 0,
            "context_length": config.context_per_sequence,
        }
        return {"models": [loaded_entry]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        front.authorise(request)
        body: ShowBody = await front.parse(request, ShowBody)
        name = body.model or body.name
        if name is None:
            raise invalid("model is required", "model")
        ring = await front.ready_ring(served_id(name, config))
        return model_card(config, ring)

    @app.post("/api/chat", response_model=None)
    async def chat(request: Request) -> Response:
        front.authorise(request)
        body: ChatBody = await front.parse(request, ChatBody)
        model_id = served_id(body.model, config)
        if not body.messages:
            return JSONResponse(loaded(body.model, True, body.keep_alive))
        ask = body.ask(config.context_per_sequence)
        ring = await front.ready_ring(model_id)
        show_thinking = thinking_asked(body.think, body.model, ring)
        prepared, prompt = await front.chat_prompt(ring, ask, "messages")
        writer = OllamaWriter(new_id("chat-"), body.model, True, prepared.reader, show_thinking, body.logprobs is True)
        served = ServeRequest(prompt, "messages", ask.generation, prepared.grammar, body.streams())
        return await front.serve(request, served, ring, writer)

    @app.post("/api/generate", response_model=None)
    async def generate(request: Request) -> Response:
        front.authorise(request)
        body: GenerateBody = await front.parse(request, GenerateBody)
        model_id = served_id(body.model, config)
        if not body.prompt:
            return JSONResponse(loaded(body.model, False, body.keep_alive))
        ask = body.ask(config.context_per_sequence)
        ring = await front.ready_ring(model_id)
        logprobs = body.logprobs is True
        if isinstance(ask, TextAsk):
            completion = prepare_completion(ask, ring.n_vocab())
            assert completion.text is not None
            prompt = await front.tokenize(ring, completion.text, True, False, "prompt")
            writer = OllamaWriter(new_id("gen-"), body.model, False, None, True, logprobs)
            served = ServeRequest(prompt, "prompt", ask.generation, completion.grammar, body.streams())
            return await front.serve(request, served, ring, writer)
        show_thinking = thinking_asked(body.think, body.model, ring)
        prepared, prompt = await front.chat_prompt(ring, ask, "prompt")
        writer = OllamaWriter(new_id("gen-"), body.model, False, prepared.reader, show_thinking, logprobs)
        served = ServeRequest(prompt, "prompt", ask.generation, prepared.grammar, body.streams())
        return await front.serve(request, served, ring, writer)


def thinks(ring: ServingHandle) -> bool:
    template = ring.template
    return template.thinks or template.reply_syntax is ReplySyntax.HARMONY


def thinking_asked(think: bool | str | None, name: str, ring: ServingHandle) -> bool:
    """Whether the reply shows the model's reasoning (`thinking`): unless `think` is false. A
    model that does not think cannot be asked to (a 400, as Ollama's)."""
    if think not in (None, False) and not thinks(ring):
        raise invalid(f'"{name[:256]}" does not support thinking: its chat template writes no reasoning', "think")
    return think is not False


def capabilities(ring: ServingHandle) -> list[str]:
    found = ["completion"]
    if ring.template.tool_syntax is not None:
        found.append("tools")
    if thinks(ring):
        found.append("thinking")
    return found


def details(ring: ServingHandle | None) -> dict[str, Any]:
    family = (ring.architecture if ring is not None else None) or ""
    return {
        "parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
        "parameter_size": "", "quantization_level": "",
    }  # fmt: skip


def model_entry(config: ApiConfig, ring: ServingHandle | None) -> dict[str, Any]:
    """The model as `/api/tags` lists it. Its digest names the served id (Kafila serves no blobs);
    its size on disk is not known here, so 0."""
    name = ollama_name(config.model_id)
    return {
        "name": name, "model": name,
        "modified_at": datetime.fromtimestamp(config.created, UTC).isoformat().replace("+00:00", "Z"),
        "size": 0, "digest": hashlib.sha256(config.model_id.encode()).hexdigest(), "details": details(ring),
    }  # fmt: skip


def model_card(config: ApiConfig, ring: ServingHandle) -> dict[str, Any]:
    """`/api/show`: what the model can do (`capabilities`, which clients read to offer tools and
    thinking), its architecture and context (`model_info`), and its chat template (Jinja, as
    the GGUF file holds it, not a Go template)."""
    architecture = ring.architecture or "unknown"
    info = {"general.architecture": architecture, f"{architecture}.context_length": config.context_per_sequence}
    return {
        "license": "", "modelfile": f"# Served by Kafila\nFROM {config.model_id}\n", "parameters": "",
        "template": ring.engine.chat_template() or "", "details": details(ring), "model_info": info,
        "capabilities": capabilities(ring),
        "modified_at": datetime.fromtimestamp(config.created, UTC).isoformat().replace("+00:00", "Z"),
    }  # fmt: skip
