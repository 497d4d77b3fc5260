"""What the API checks of a request before anything reads its meaning, pure: the body is JSON
of bounded depth that a tokenizer can take, sent as JSON, to a host name this server answers to.

Why each. A web page in the user's browser can POST to `localhost` without asking first when
the body's type is `text/plain` or a form ("simple" requests skip CORS's preflight), so only
`application/json` is taken. A page can also rebind its own domain name to 127.0.0.1 (DNS
rebinding) and then read the answers, so the `Host` header must be an address, `localhost`, or
a name the operator allowed: a rebinding page always names its own domain. A body nested a
hundred thousand levels deep would exhaust Python's recursion in the parser or the validator,
so depth is bounded well past any real request.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

MAX_JSON_DEPTH = 64  # a chat request nests about 5 levels; tools' JSON schemas a few more
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyRefused(ValueError):
    """A body the API cannot take; `status` is the HTTP status that says so."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def json_object(body: bytes, content_type: str | None) -> dict[str, object]:
    """The request's JSON object, or BodyRefused saying what is wrong with it."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise BodyRefused(
            f"The request body must be sent as JSON (Content-Type: application/json), not {media_type or 'untyped'}; "
            "with curl, add -H 'Content-Type: application/json'.",
            415,
        )
    try:
        data = json.loads(body)
    except RecursionError:
        raise BodyRefused(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    except (ValueError, UnicodeDecodeError):
        raise BodyRefused("We could not parse the JSON body of your request.") from None
    if not isinstance(data, dict):
        raise BodyRefused("The request body must be a JSON object.")
    if depth(data) > MAX_JSON_DEPTH:
        raise BodyRefused(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    try:  # JSON may escape a lone UTF-16 surrogate, which no tokenizer or template can take
        if _SURROGATE_ESCAPE.search(body):  # only an escape can make one: check the text then
            json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise BodyRefused("The request body holds a lone UTF-16 surrogate (such as \\ud800), not text.") from None
    return data


def depth(value: object) -> int:
    """How deeply lists and objects nest in `value` (a scalar is 0), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_JSON_DEPTH:  # past the bound the answer is known: stop looking deeper
            pending.extend((child, level + 1) for child in children)
    return deepest


def host_allowed(host_header: str | None, allowed: Collection[str]) -> bool:
    """Whether a request naming `host_header` is for this server: an IP address, `localhost`,
    or one of the names the operator allowed (`--allow-host`). No header (HTTP/1.0) is a
    program's, never a browser's."""
    if host_header is None:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    host = host.rstrip(".")
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or host in {name.lower() for name in allowed}


class TrustedHosts:
    """Refuses, before any route runs, a request whose `Host` this server does not answer to."""

    def __init__(self, app: ASGIApp, allowed: Collection[str]) -> None:
        self.app, self.allowed = app, frozenset(name.strip().lower().rstrip(".") for name in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not host_allowed(Headers(scope=scope).get("host"), self.allowed):
            name = Headers(scope=scope).get("host", "")[:100]
            message = (
                f"This server does not answer to the host name {name!r} (a web page may be trying to reach it). "
                "Use its address or localhost, or start it with --allow-host NAME."
            )
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "bad_host"}}
            await JSONResponse(body, status_code=421)(scope, receive, send)
            return
        await self.app(scope, receive, send)
