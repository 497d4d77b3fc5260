"""OpenAI's chat completions, text completions and models: each body parsed into its ask
(`schemas`), prepared (`requests`) and served through OpenAI's writers (`openai_replies`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response

from kafila.api.errors import ApiError, invalid
from kafila.api.front import ApiConfig, Front, new_id
from kafila.api.openai_replies import ChatWriter, CompletionWriter
from kafila.api.requests import ServeRequest, prepare_completion
from kafila.api.schemas import ChatRequest, CompletionRequest

ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models"


def install(app: FastAPI, front: Front) -> None:
    config = front.config

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        front.authorise(request)
        return {"object": "list", "data": [model_card(config)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        front.authorise(request)
        if model != config.model_id:
            raise ApiError(404, f"The model '{model}' does not exist.", "invalid_request_error", "model_not_found")
        return model_card(config)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        front.authorise(request)
        body: ChatRequest = await front.parse(request, ChatRequest)
        ask = body.ask()
        ring = await front.ready_ring(body.model)
        prepared, prompt = await front.chat_prompt(ring, ask, "messages")
        logprobs, usage = reply_options(body)
        writer = ChatWriter(new_id("chatcmpl-"), config.model_id, logprobs, usage, reader=prepared.reader)
        served = ServeRequest(prompt, "messages", ask.generation, prepared.grammar, body.stream)
        return await front.serve(request, served, ring, writer)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        front.authorise(request)
        body: CompletionRequest = await front.parse(request, CompletionRequest)
        try:
            ask = body.ask()
        except ValueError as error:
            raise invalid(str(error), "prompt") from None
        ring = await front.ready_ring(body.model)
        prepared = prepare_completion(ask, ring.n_vocab())
        prompt = prepared.tokens
        if prompt is None:
            assert prepared.text is not None
            prompt = await front.tokenize(ring, prepared.text, True, False, "prompt")
        writer = CompletionWriter(new_id("cmpl-"), config.model_id, *reply_options(body))
        served = ServeRequest(prompt, "prompt", ask.generation, prepared.grammar, body.stream)
        return await front.serve(request, served, ring, writer)


def reply_options(body: ChatRequest | CompletionRequest) -> tuple[bool, bool]:
    """What an OpenAI request asks of its reply's shape beyond its text: log probabilities, and
    a stream's closing usage chunk."""
    usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return body.logprob_alternatives() is not None, usage


def model_card(config: ApiConfig) -> dict[str, Any]:
    return {"id": config.model_id, "object": "model", "created": config.created, "owned_by": "kafila"}
