"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`): its body
parsed into a `ChatAsk`, prepared and served as chat completions are, and the reply written as
output items (reasoning, a message, function calls), whole or as the API's named events.

The conversation is `input` (a string, or items: messages, function calls and their outputs,
reasoning sent back) after `instructions`, continuing a stored response's where
`previous_response_id` names one (`responses_store`). Built-in tools (web search, file search,
…) and inputs this server cannot take (images, files) are refused with a 400 that names them;
fields it does not know are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, Response

from kafila.api.asks import Turn
from kafila.api.errors import ApiError, invalid
from kafila.api.front import Front, new_id
from kafila.api.requests import ServeRequest
from kafila.api.responses_replies import ResponsesWriter
from kafila.api.responses_schemas import ITEMS, parse, read_items
from kafila.api.responses_store import ResponseStore, StoredResponse

ROUTES = "POST /v1/responses, GET and DELETE /v1/responses/{id}"


def conversation_after(response: dict[str, Any], turns: Sequence[Turn], calls: dict[str, str]) -> StoredResponse:
    """What a finished response leaves for one that continues it: its turns, then its output's."""
    said, calls = read_items(ITEMS.validate_python(response["output"]), dict(calls), "output")
    return StoredResponse(response, (*turns, *said), calls)


PARAMS = {"messages": "input", "response_format": "text.format"}  # the shared layer's names, as this API's


def install(app: FastAPI, front: Front, store: ResponseStore | None = None) -> ResponseStore:
    """The routes, over `store` (a new one by default); returns the store."""
    config = front.config
    kept = store if store is not None else ResponseStore()

    @app.post("/v1/responses", response_model=None)
    async def create(request: Request) -> Response:
        front.authorise(request)
        body = await parse(request)
        earlier: tuple[Turn, ...] = ()
        made: dict[str, str] = {}
        if body.previous_response_id is not None:
            previous = kept.get(body.previous_response_id, "previous_response_id")
            earlier, made = previous.turns, previous.calls
        ask, calls = body.ask(earlier, made)
        ring = await front.ready_ring(body.model)
        try:
            prepared, prompt = await front.chat_prompt(ring, ask, "input")
        except ApiError as error:
            error.param = PARAMS.get(error.param or "", error.param)
            raise
        conversation = ask.turns[1:] if body.instructions is not None else ask.turns

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                kept.put(response["id"], conversation_after(response, conversation, calls))

        def count_tokens(text: str) -> int:
            return len(ring.tokenize(text, False, False))

        writer = ResponsesWriter(new_id("resp_"), config.model_id, body.echo(), prepared.reader, keep, count_tokens)
        served = ServeRequest(prompt, "input", ask.generation, prepared.grammar, body.stream)
        try:
            return await front.serve(request, served, ring, writer)
        except ApiError as error:
            error.param = PARAMS.get(error.param or "", error.param)
            raise

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
        front.authorise(request)
        if request.query_params.get("stream") in ("true", "1"):
            raise invalid("This server does not replay a stored response as a stream; ask without stream.", "stream")
        return kept.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        front.authorise(request)
        kept.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return kept
