"""The HTTP process of `moemesh serve` (inference/server.py starts it): FastAPI on uvicorn, the
OpenAI protocol (protocol.py), the chat template and the tokenizer's encoding, and the link to the
engine's process (link.py). The routes, their errors and their streams are server.py's docstring.

It imports no torch (a test checks): the process starts in a fraction of a second and holds no
torch in its memory. The modules it reads (link, protocol, responses, responses_api, request, chat,
grammar) keep to that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import multiprocessing.connection
import socket
import time
import traceback
from dataclasses import dataclass

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import MoemeshError, RequestError
from moemesh.inference.chat import ChatTemplate, load_chat_template
from moemesh.inference.grammar import Grammars
from moemesh.inference.link import HttpLink, Submitted
from moemesh.inference.parsers.harmony import TURN_ENDS
from moemesh.inference.parsers.registry import NONE, choose
from moemesh.inference.protocol import ApiError, Plan, Served, bad, chat_plan, completion_plan
from moemesh.inference.request import QueueFull, short
from moemesh.inference.responses import Reply
from moemesh.inference.responses_api import ResponseReply, responses_plan

try:  # one line for the user where `moemesh[serve]`'s packages are missing
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:
    raise MoemeshError(f"moemesh serve needs fastapi and uvicorn ({e}): pip install 'moemesh[serve]'") from e


@dataclass(frozen=True)
class HttpSettings:
    """What the HTTP process needs (pickled to it)."""

    tokenizer: Tokenizer
    model_name: str
    api_key: str | None
    max_request_bytes: int
    max_len: int
    vocab: int
    max_waiting: int
    model_type: str | None = None  # the parsers are chosen from it and the chat template
    tool_call_parser: str | None = None  # serve's --tool-call-parser (None: chosen; "none": no parser)
    reasoning_parser: str | None = None  # serve's --reasoning-parser (the same)


class Front:
    """What the app answers with: the settings, the protocol's view of the model, the link."""

    def __init__(self, settings: HttpSettings, link: HttpLink):
        self.link, self.tokenizer, self.model_name = link, settings.tokenizer, settings.model_name
        self.api_key, self.max_request_bytes = settings.api_key, settings.max_request_bytes
        self.chat_template: ChatTemplate | None = load_chat_template(settings.tokenizer)
        chat_stop_ids: tuple[int, ...] = ()
        if self.chat_template is not None:  # the eos token, and the template's end of turn where it differs
            for end in dict.fromkeys(e for e in (self.chat_template.eos_token, self.chat_template.end_of_turn) if e):
                ids = settings.tokenizer.encode(end)
                chat_stop_ids += tuple(ids) if len(ids) == 1 else ()
        source = self.chat_template.source if self.chat_template is not None else None
        tools, reasoning = choose(settings.model_type, source)
        tools = tools if settings.tool_call_parser is None else settings.tool_call_parser
        reasoning = reasoning if settings.reasoning_parser is None else settings.reasoning_parser
        self.tool_parser, self.reasoning_parser = (None if p == NONE else p for p in (tools, reasoning))
        if "harmony" in (self.tool_parser, self.reasoning_parser):  # gpt-oss's turn ends at a call too
            for marker in TURN_ENDS:
                ids = settings.tokenizer.encode(marker)
                if len(ids) == 1 and ids[0] not in chat_stop_ids:
                    chat_stop_ids += tuple(ids)
        self.served = Served(
            settings.tokenizer,
            settings.max_len,
            settings.vocab,
            self.chat_template,
            chat_stop_ids,
            Grammars(settings.tokenizer, settings.vocab),
            settings.max_waiting,  # a request that fits an empty queue (more could be refused with 503 forever)
            self.tool_parser,
            self.reasoning_parser,
        )
        self.created = int(time.time())


def main(link_fd: int, sock_fd: int) -> None:
    """The HTTP process: uvicorn on the listening socket `sock_fd` until the engine's process, at
    the other end of `link_fd`, says stop or ends. The link's first message is the settings."""
    conn = multiprocessing.connection.Connection(link_fd)
    settings: HttpSettings = conn.recv()
    sock = socket.socket(fileno=sock_fd)
    link = HttpLink(conn)
    server = uvicorn.Server(
        uvicorn.Config(_create_app(Front(settings, link)), log_level="warning", timeout_graceful_shutdown=5)
    )

    def stop():
        server.should_exit = True

    link.on_shutdown = stop
    server.run(sockets=[sock])


# ---- the app ---------------------------------------------------------------------------------------


class ErrorResponse(JSONResponse):
    """An error object, ASCII-escaped: it may quote what the client sent (lone surrogates included)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def _error(error: ApiError) -> ErrorResponse:
    return ErrorResponse(error.body(), status_code=error.status, headers=error.headers)


class AccessLog:
    """ASGI middleware: one line a request for the `moemesh.serve` logger (`emit(level, line)`),
    once its response is complete (a stream's too): method, path, status, tokens (when it ran),
    seconds."""

    def __init__(self, app, emit):
        self.app, self.emit = app, emit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        state = scope.setdefault("state", {})

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            reply = state.get("reply")
            tokens = ""
            if reply is not None:
                usage = reply.usage()
                tokens = f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
            seconds = time.perf_counter() - start
            self.emit(logging.INFO, f"{scope['method']} {scope['path']} {status[0]}{tokens} {seconds:.3f} s")


JSON_TYPES = ("application/json",)


def _create_app(service: Front) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.link.start()  # the engine's messages in, and the engine's process told we serve
        yield

    app = FastAPI(title="moemesh", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(AccessLog, emit=service.link.log)

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return _error(error)

    @app.exception_handler(RequestError)
    async def request_error(request, error: RequestError):
        return _error(bad(error))

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):  # unknown paths and methods, in OpenAI's shape
        return _error(ApiError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def server_error(request, error: Exception):  # a bug: still OpenAI's shape (and logged)
        trace = "".join(traceback.format_exception(error))
        what = f"moemesh serve: an error while answering {request.method} {request.url.path}"
        service.link.log(logging.ERROR, f"{what}\n{trace.rstrip()}")
        return _error(ApiError(500, f"internal error ({type(error).__name__})", kind="server_error"))

    def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {service.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        kind = request.headers.get("content-type")
        if kind is not None:
            media = kind.split(";")[0].strip().lower()
            if media not in JSON_TYPES and not media.endswith("+json"):
                raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {short(media)}")
        length = request.headers.get("content-length")
        too_large = ApiError(
            413, f"the request body is over {service.max_request_bytes} bytes", code="request_too_large"
        )
        if length is not None and length.isdigit() and int(length) > service.max_request_bytes:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > service.max_request_bytes:
                raise too_large
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, numbers of > 4300 digits, deep nesting
            raise ApiError(400, f"the body is not valid JSON ({short(str(e), 120)})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = data.get("model", service.model_name)
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string", "model")
        check_model(model)
        return data

    def check_model(model: str) -> None:
        if model != service.model_name:
            raise ApiError(
                404,
                f"the model {short(model)} does not exist; this server has {service.model_name!r}",
                "model",
                "model_not_found",
            )

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "moemesh"}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        authorize(request)
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await respond(request, completion_plan(await read_json(request), service.served))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await respond(request, chat_plan(await read_json(request), service.served))

    @app.post("/v1/responses")
    async def responses(request: Request):
        authorize(request)
        planned = responses_plan(await read_json(request), service.served)
        return await respond(
            request, planned.plan, lambda views: ResponseReply(service.model_name, planned, views, service.tokenizer)
        )

    async def respond(request: Request, plan: Plan, make_reply=None):
        asks = [(ids, params) for ids, choices in zip(plan.prompts, plan.params) for params in choices]
        try:
            submitted = await service.link.submit(asks)
        except QueueFull as e:
            raise ApiError(503, f"the server is busy: {e}", code="server_busy", kind="server_error") from None
        except RequestError as e:
            raise bad(e) from None
        if make_reply is None:
            reply = Reply(service.model_name, plan, submitted.views, service.tokenizer)
        else:
            reply = make_reply(submitted.views)
        request.state.reply = reply
        if plan.stream:
            return StreamingResponse(stream(submitted, reply, plan.include_usage), media_type="text/event-stream")
        finished = 0

        async def all_finished():
            nonlocal finished
            while finished < len(submitted.views):
                _, _, reason, _ = await submitted.updates.get()
                finished += reason is not None

        work = asyncio.ensure_future(all_finished())
        watcher = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            watcher.cancel()
            service.link.cancel(submitted)  # a no-op for finished ones; frees the rows of a client that left
        if not work.done() or work.cancelled():
            return None  # the client left: nobody to answer
        failed = next((s for s in submitted.views if s.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error}", kind="server_error")
        return reply.whole()

    async def stream(submitted: Submitted, reply: Reply, include_usage: bool):
        updates = submitted.updates
        try:
            for event in reply.first_events():
                yield event
            finished, started = 0, set()
            while finished < len(reply.sequences):
                events = []  # what has come since the last write, in one write
                for index, text, reason, tokens in [await updates.get(), *_drain(updates)]:
                    finished += reason is not None
                    if reason == "error":
                        error = ApiError(500, f"generation failed: {reply.sequences[index].error}", kind="server_error")
                        events.append(reply.error_event(error))
                    else:
                        events.append(reply.event(index, text, reason, tokens, first=index not in started))
                        started.add(index)
                yield "".join(events)
            for event in reply.last_events(include_usage):
                yield event
        finally:  # also when the client went away: Starlette cancels this generator
            service.link.cancel(submitted)

    return app


async def disconnected(request: Request) -> None:
    """Return when the client has gone (the ASGI server's http.disconnect, which arrives as soon as
    the connection closes: the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
