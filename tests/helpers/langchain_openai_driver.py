"""langchain-openai's `ChatOpenAI` against a Kafila host, run by its own virtual environment's
python (`.clients/langchain-openai`): `python langchain_openai_driver.py SCENARIO BASE_URL KEY
MODEL [PROMPT TOKENS]`. SCENARIO:
- `text`: PROMPT invoked and streamed at temperature 0 with at most TOKENS tokens; prints
  `ChatTexts`;
- `tools`: `bind_tools` with one tool, invoked; prints the reply's parsed calls as a `Turn`;
- `structured`: `with_structured_output` of a pydantic model; prints a `StructuredAnswer`."""

from __future__ import annotations

import sys

from client_reports import CallSeen, ChatTexts, StructuredAnswer, Turn
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="The city")


class City(BaseModel):
    name: str
    rainy: bool


def texts(chat: ChatOpenAI, prompt: str) -> ChatTexts:
    invoked = chat.invoke(prompt).content
    chunks = [chunk.content for chunk in chat.stream(prompt)]
    assert isinstance(invoked, str) and all(isinstance(chunk, str) for chunk in chunks)
    return ChatTexts(invoked=invoked, streamed="".join(map(str, chunks)), text_chunks=sum(1 for c in chunks if c))


def tool_calls(chat: ChatOpenAI) -> Turn:
    reply = chat.bind_tools([GetWeather]).invoke("What is the weather in Oslo?")
    assert isinstance(reply, AIMessage)
    calls = [CallSeen(call_id=call["id"] or "", name=call["name"], arguments=call["args"]) for call in reply.tool_calls]
    return Turn(outputs_sent=[], calls=calls)


def structured(chat: ChatOpenAI) -> StructuredAnswer:
    answer = chat.with_structured_output(City).invoke("Is it raining in Oslo?")
    assert isinstance(answer, BaseModel)
    return StructuredAnswer(type_name=type(answer).__name__, fields=answer.model_dump())


def main(scenario: str, base_url: str, key: str, model: str, *text_args: str) -> BaseModel:
    if scenario == "text":
        prompt, tokens = text_args
        return texts(ChatOpenAI(model=model, base_url=base_url, api_key=key, temperature=0, max_tokens=int(tokens)),
                     prompt)  # fmt: skip
    chat = ChatOpenAI(model=model, base_url=base_url, api_key=key)
    return tool_calls(chat) if scenario == "tools" else structured(chat)


if __name__ == "__main__":
    print(main(*sys.argv[1:]).model_dump_json())
