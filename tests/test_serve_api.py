"""`kafila host` through the official `openai` client: a real server, a real ring, real llama.cpp.

The host runs a tiny llama model split across two local stage processes, with an API key.
Greedy output through it must equal the unsplit model run in this process.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import openai
import pytest
from host_process import Host, report_covers_requests, running_host
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatText
from serving_checks import check_concurrent_streams, unsplit_greedy, unsplit_text
from tiny_models import write_tiny_model
from waiting import until

from kafila.contracts import SpeculationStatus
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.backends import backend_report

KEY = "test-key-123"
MODEL = "tiny-llama"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / f"{MODEL}.gguf", "llama", n_blocks=4)


@pytest.fixture(scope="module")
def host(model: Path) -> Iterator[Host]:
    args = ("--model", model, "--division", "2,2", "--context", "256", "--concurrency", "4", "--threads", "1")
    # Two waves in flight: local stages keep one by default (they share this machine's cores),
    # but the serving path must be right with several, as on a ring of machines.
    with running_host(*args, api_key=KEY, env={"KAFILA_PIPELINE_WAVES": "2"}) as running:
        yield running


@pytest.fixture(scope="module")
def client(host: Host) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{host.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def raw(host: Host, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = Request(f"{host.base_url}{path}", data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except HTTPError as error:
        return error.code, json.loads(error.read())


def metrics(host: Host) -> str:
    request = Request(f"{host.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urlopen(request, timeout=10) as response:
        return str(response.read().decode())


def sent(host: Host, body: bytes, headers: dict[str, str], path: str = "/v1/completions") -> tuple[int, str]:
    """POST `body` with exactly these headers (and the key); the status and the error's message."""
    request = Request(f"{host.base_url}{path}", data=body, headers={"Authorization": f"Bearer {KEY}", **headers})
    try:
        with urlopen(request, timeout=30) as response:
            return response.status, ""
    except HTTPError as error:
        return error.code, str(json.loads(error.read())["error"]["message"])


def test_a_web_page_cannot_post_to_the_api_or_reach_it_by_rebinding_a_name(host: Host) -> None:
    """A page may POST a "simple" request (text/plain, a form) without a CORS preflight, and may
    rebind its own domain to this machine: both are refused before any route runs."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
    assert sent(host, body, {"Content-Type": "application/json"})[0] == 200
    for simple in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, message = sent(host, body, {"Content-Type": simple})
        assert status == 415 and "Content-Type: application/json" in message, (simple, message)
    port = host.base_url.rsplit(":", 1)[1]
    for name in ("localhost", "127.0.0.1", "[::1]", "LOCALHOST."):
        assert sent(host, body, {"Content-Type": "application/json", "Host": f"{name}:{port}"})[0] == 200, name
    status, message = sent(host, body, {"Content-Type": "application/json", "Host": f"attacker.example:{port}"})
    assert status == 421 and "--allow-host" in message, message
    status, _ = sent(host, b"", {"Host": "attacker.example"}, "/health")
    assert status == 421


def test_a_body_nested_past_any_real_request_is_refused_with_a_400(host: Host) -> None:
    for levels in (65, 1_000, 200_000):  # the last exhausts Python's recursion in any parser
        nested = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "user": ' + b"[" * levels + b"]" * levels + b"}"
        status, message = sent(host, nested, {"Content-Type": "application/json"})
        assert status == 400 and "nests deeper" in message, (levels, status, message)


def test_models_lists_the_one_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_a_greedy_completion_through_the_ring_equals_the_unsplit_model(client: openai.OpenAI, model: Path) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text and result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
    assert result.usage is not None and result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    assert result.choices[0].finish_reason == "length"


def test_a_chat_completion_and_its_stream_agree(client: openai.OpenAI) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    content = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and content
    assert whole.usage is not None and whole.usage.prompt_tokens > 5
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_completion_without_max_tokens_stops_at_openais_default_of_16(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    assert result.usage is not None and result.usage.completion_tokens == 16
    assert result.choices[0].finish_reason == "length"


def test_stop_strings_seed_and_penalties_are_honoured(client: openai.OpenAI, model: Path) -> None:
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    # Three characters past the start, whatever the random model wrote: none a byte not yet UTF-8
    # (U+FFFD), which a stop string cannot match as the tokens come.
    windows = [free[i : i + 3] for i in range(1, len(free) - 2)]
    stop = next((w for w in windows if "\ufffd" not in w and w.strip()), None)
    assert stop is not None, f"no three plain characters to stop on in {free!r}"
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.find(stop)] and cut.choices[0].finish_reason == "stop"
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9}
    a = client.completions.create(**kwargs, seed=7).choices[0].text  # type: ignore[call-overload]
    b = client.completions.create(**kwargs, seed=7).choices[0].text  # type: ignore[call-overload]
    assert a == b
    # Each penalty alone and both, against the unsplit model sampled the same way (OpenAI's defaults:
    # no top-k, top_p 1): each reached the sampler, and changed what greedy decoding alone writes.
    greedy = unsplit_greedy(model, PROMPT, 24)
    for frequency, presence in ((2.0, 0.0), (0.0, 2.0), (2.0, 2.0)):
        penalised = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, frequency_penalty=frequency,
            presence_penalty=presence,
        )  # fmt: skip
        assert penalised.usage is not None and penalised.usage.completion_tokens >= 1
        same_way = SamplingSettings(
            temperature=0.0, top_k=0, top_p=1.0, frequency_penalty=frequency, presence_penalty=presence
        )
        assert penalised.choices[0].text == unsplit_text(model, PROMPT, 24, same_way), (frequency, presence)
        assert penalised.choices[0].text != greedy, (frequency, presence)


def test_four_concurrent_streams_all_complete_with_their_own_text(client: openai.OpenAI, model: Path) -> None:
    check_concurrent_streams(client, MODEL, lambda prompt, n: unsplit_greedy(model, prompt, n))


def test_openai_errors_carry_openais_status_codes(client: openai.OpenAI, host: Host) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    status, body = raw(host, "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as overflow:
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=1)
    assert overflow.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=250)  # prompt + 250 > 256
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=9)
    for body_bytes in (b"{not json", b"[1, 2]", b'{"model": "tiny-llama"}', b"\xff\xfe"):
        status, reply = raw(host, "/v1/chat/completions", body_bytes)
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", (body_bytes, reply)  # type: ignore[index]
    oversized = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * (17 << 20) + b'"}'
    status, reply = raw(host, "/v1/completions", oversized)
    assert status == 413 and reply["error"]["code"] == "request_too_large", reply  # type: ignore[index]
    connection = http.client.HTTPConnection(host.base_url.removeprefix("http://"), timeout=30)
    pieces = (oversized[i : i + (1 << 20)] for i in range(0, len(oversized), 1 << 20))  # no length declared
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    connection.request("POST", "/v1/completions", body=pieces, headers=headers, encode_chunked=True)
    assert connection.getresponse().status == 413
    connection.close()
    with pytest.raises(openai.BadRequestError, match="characters, more than") as beyond:  # refused untokenized
        client.completions.create(model=MODEL, prompt="a" * (256 * 1024 + 1), max_tokens=1)
    assert beyond.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="tokens in the prompt") as long:  # tokenized off the loop
        client.completions.create(model=MODEL, prompt="word " * 20_000, max_tokens=1)
    assert long.value.code == "context_length_exceeded"
    lone_surrogate = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}'.encode()
    status, reply = raw(host, "/v1/chat/completions", lone_surrogate)
    assert status == 400 and "surrogate" in reply["error"]["message"], reply  # type: ignore[index]
    for prompt, says in (([], "empty"), ([-1], "from 0 to"), ([5, 1 << 20], "from 0 to")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={"5": 10})
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="response_format"):  # json_schema without its schema
        client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_schema"})  # type: ignore[typeddict-item]
    text_format: ResponseFormatText = {"type": "text"}
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, response_format=text_format)
    assert plain.choices[0].finish_reason in ("length", "stop")


def test_what_this_server_cannot_take_is_named(client: openai.OpenAI, host: Host, model: Path) -> None:
    """A route it does not serve, a part that is not text, several prompts in one: each refusal
    says what was asked and what is served, in OpenAI's shape."""
    with pytest.raises(openai.NotFoundError, match="Invalid URL") as unknown:
        client.embeddings.create(model=MODEL, input="hello")
    assert unknown.value.code == "unknown_url"
    served = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat")
    assert all(route in str(unknown.value) for route in served), str(unknown.value)
    status, reply = raw(host, "/v1/models", b"{}")  # POST where only GET is served
    assert status == 405 and reply["error"]["code"] == "method_not_allowed", reply  # type: ignore[index]
    image: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}
    ]
    with pytest.raises(openai.BadRequestError, match="'image_url' part") as part:
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=1)
    assert "Value error" not in str(part.value)
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=1)
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=6, temperature=0).choices[0].text
    assert ids == client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0).choices[0].text


def covered_status(host: Host) -> dict[str, object]:
    """/status once its stage report covers every request the ring has finished."""
    until(lambda: report_covers_requests(raw(host, "/status")[1]), "a stage report with every finished request")
    return raw(host, "/status")[1]


def test_the_stage_report_says_which_requests_it_covers_and_moves_as_they_finish(
    client: openai.OpenAI, host: Host
) -> None:
    """`stages_cover`: the requests and tokens the ring had done when the stages' report was taken.
    Once it covers every finished request, the stages' figures count the work of those requests."""
    before = covered_status(host)
    made = 0
    for _ in range(2):
        result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        made += result.usage.completion_tokens if result.usage else 0
    after = covered_status(host)
    was, cover, requests = before["stages_cover"], after["stages_cover"], after["requests"]
    assert isinstance(was, dict) and isinstance(cover, dict) and isinstance(requests, dict), after
    assert made > 0 and cover["requests"] == requests["finished"] + requests["failed"] >= was["requests"] + 2
    assert cover["generated_tokens"] >= was["generated_tokens"] + made
    rows_before = [stage["rows"] for stage in before["stages"]]  # type: ignore[union-attr]
    rows_after = [stage["rows"] for stage in after["stages"]]  # type: ignore[union-attr]
    assert len(rows_after) == 2 and all(a > b for a, b in zip(rows_after, rows_before, strict=True)), (
        rows_before, rows_after,
    )  # fmt: skip


def test_health_status_and_metrics_describe_the_session(client: openai.OpenAI, host: Host) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    status, health = raw(host, "/health", key=None)
    assert status == 200 and health == {"status": "ready", "model": MODEL}
    status, info = raw(host, "/status")
    assert status == 200 and info["ready"] is True and info["division"] == [2, 2]
    assert info["members"][0]["backend"]["serving"] == backend_report().serving  # type: ignore[index]
    assert f"llama.cpp serves on {backend_report().serving[0]} (" in host.output()  # said as it started
    assert info["pipeline_waves"] == 2
    assert info["requests"]["finished"] >= 1  # type: ignore[index]
    assert info["requests_by_dialect"]["openai completions"] >= 1  # type: ignore[index]
    speculation = info["speculation"]  # n-gram drafts by default, checked in the trip they ride on
    assert speculation["mode"] == "ngram" and speculation["off"] is None, speculation  # type: ignore[index]
    # Every figure the contract holds, the cost rule's among them (the trip, what carrying drafts
    # adds to a wave, a drafted row: None until the waves measure them).
    reported = SpeculationStatus.model_validate(speculation).model_fields_set
    assert {"trip_ms", "fixed_ms", "row_ms"} <= reported and reported == set(SpeculationStatus.model_fields), reported
    assert raw(host, "/status", key=None)[0] == 401
    assert raw(host, "/metrics", key=None)[0] == 401  # with --api-key, what the session looks like is the key's too
    text = metrics(host)
    assert "kafila_completion_tokens_total" in text and "kafila_queue_depth" in text
    assert "kafila_speculation_drafted_tokens" in text and "kafila_speculation_accepted_per_trip" in text
    completion_total = next(line for line in text.splitlines() if line.startswith("kafila_completion_tokens_total"))
    assert float(completion_total.split()[-1]) >= 4
    # Requests are counted by route and status; a path that is no route counts as "other".
    assert 'kafila_requests_total{route="/v1/completions",status="200"}' in text
    assert 'kafila_dialect_requests_total{dialect="openai completions"}' in text
    raw(host, "/v1/no-such-route-1234", key=None)
    text = metrics(host)
    assert 'kafila_requests_total{route="other",status="404"}' in text and "no-such-route" not in text
