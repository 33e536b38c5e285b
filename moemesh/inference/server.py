"""`moemesh serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the
scheduler, so that the official `openai` client works unchanged. HTTP only: requests are read and
checked by protocol.py, answered in responses.py's objects, and run by the scheduler's thread.

    GET  /health                   200 while serving (no key needed)
    GET  /v1/models                the one model
    GET  /v1/models/{id}           it, or a 404 for another id
    POST /v1/completions           prompt: text or token ids, one or a list (docs/openai_api.md)
    POST /v1/chat/completions      for tokenizers with a chat template (chat.py); else 400

Streams are server-sent events, one chunk per token (with the text that became final, maybe ""),
ending in `data: [DONE]`; the chunks that have come since a stream's last write go in one write.
Errors are OpenAI's error object with their status, never plain text: 400 for a bad body or
field (protocol.py names it), 401 without the API key (when one is set), 404 for another model
or path, 405 for another method, 413 for a body over the limit, 415 for a body that is not JSON,
500 when a request's generation fails (that request alone), 503 with Retry-After when the
waiting queue is full.

A client that leaves frees its rows at the next step: a stream's end cancels its sequences, and
while a non-streaming request runs, a watcher waits for the connection's http.disconnect message.
Each request is logged on the `moemesh.serve` logger in one line: method, path, status, prompt
and completion tokens, seconds.

This module needs fastapi and uvicorn (`pip install moemesh[serve]`); nothing else imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import RequestError
from moemesh.inference.chat import ChatTemplate, load_chat_template
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.protocol import ApiError, Plan, Served, bad, chat_plan, completion_plan
from moemesh.inference.request import Sequence, short
from moemesh.inference.responses import Reply
from moemesh.inference.scheduler import QueueFull, Scheduler

log = logging.getLogger("moemesh.serve")
SWITCH_INTERVAL_S = 2e-4


class Service:
    """The scheduler on its own thread and the HTTP app that feeds it."""

    def __init__(
        self,
        engine: DecodeEngine,
        tokenizer: Tokenizer,
        model_name: str = "moemesh",
        api_key: str | None = None,
        max_waiting: int = 64,
        max_request_bytes: int = 1 << 20,
        reply_window_ms: float = 10.0,  # serve's --reply-window-ms (inference/scheduler.py says why)
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_request_bytes = api_key, max_request_bytes
        self.scheduler = Scheduler(engine, tokenizer, max_waiting, reply_window_ms / 1e3)
        self.chat_template: ChatTemplate | None = load_chat_template(tokenizer)
        self.chat_stop_ids: tuple[int, ...] = ()
        if self.chat_template is not None and self.chat_template.eos_token:
            ids = tokenizer.encode(self.chat_template.eos_token)
            self.chat_stop_ids = tuple(ids) if len(ids) == 1 else ()
        self.served = Served(
            tokenizer,
            engine.max_len,
            engine.vocab,
            self.chat_template,
            self.chat_stop_ids,
            self.scheduler.grammars,
            max_waiting,  # a request that fits an empty queue (more could be refused with 503 forever)
        )
        self.created = int(time.time())
        # Updates of this scheduler round, handed to the event loop together after it (`deliver`):
        # one wake-up of the loop a round, not one a token a client.
        self.outbox: list[tuple[asyncio.Queue, tuple]] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # uvicorn's, known from the first request
        self.app = _create_app(self)
        self.server = None  # the uvicorn server while it runs

    def serve(self, host: str = "127.0.0.1", port: int = 8000, sock=None, announce: bool | None = None) -> None:
        """Run until interrupted (or `shutdown`): the engine's warm-up, the scheduler's thread,
        then uvicorn here, on `sock` when given (bound already). `announce` (default: without
        `sock`) prints the warm-up's time and the URL."""
        import uvicorn

        announce = sock is None if announce is None else announce
        seconds = self.engine.warm_up()
        if announce:
            print(
                f"moemesh serve: decode steps of batch 1 to {self.engine.max_batch} and packed steps of up "
                f"to {self.engine.max_num_batched_tokens} tokens ready in {seconds:.1f} s",
                flush=True,
            )
        rounds = functools.partial(self.scheduler.serve_forever, after_step=self.deliver)
        worker = threading.Thread(target=rounds, name="moemesh-scheduler", daemon=True)
        # The scheduler's thread is the GPU's critical path: when a step's tokens are back it must
        # get the GIL from the event loop at once, not after Python's default 5 ms turn.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        worker.start()
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        )
        try:
            if announce:
                port = port if sock is None else sock.getsockname()[1]  # --port 0: the one the system chose
                print(f"moemesh serve: {self.model_name} on http://{host}:{port}", flush=True)
            self.server.run(sockets=None if sock is None else [sock])
        finally:
            self.scheduler.close()
            worker.join()
            sys.setswitchinterval(switch_interval)

    def deliver(self) -> None:
        """On the scheduler's thread after a round: its updates to their requests' queues."""
        if not self.outbox:
            return
        updates, self.outbox = self.outbox, []
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self.loop.call_soon_threadsafe(_put_all, updates)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def serve(
    engine: DecodeEngine, tokenizer: Tokenizer, host: str = "127.0.0.1", port: int = 8000, sock=None, **settings
) -> None:
    """Serve until interrupted (on `sock` when given, bound to host:port), a line a request on
    standard error; then release the other ranks of a tensor-parallel group."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        Service(engine, tokenizer, **settings).serve(host, port, sock, announce=True)
    finally:
        engine.close()


# ---- the app ---------------------------------------------------------------------------------------


class ErrorResponse(JSONResponse):
    """An error object, ASCII-escaped: it may quote what the client sent (lone surrogates included)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def _error(error: ApiError) -> ErrorResponse:
    return ErrorResponse(error.body(), status_code=error.status, headers=error.headers)


class AccessLog:
    """ASGI middleware: one line a request on the `moemesh.serve` logger, once its response is
    complete (a stream's too): method, path, status, tokens (when it ran), seconds."""

    def __init__(self, app):
        self.app = app

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
            log.info(
                "%s %s %d%s %.3f s", scope["method"], scope["path"], status[0], tokens, time.perf_counter() - start
            )


JSON_TYPES = ("application/json",)


def _create_app(service: Service) -> FastAPI:
    app = FastAPI(title="moemesh", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessLog)

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
        log.exception("moemesh serve: an error while answering %s %s", request.method, request.url.path)
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

    async def respond(request: Request, plan: Plan):
        service.loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        sequences: list[Sequence] = []

        def relay(index: int):
            reported = [0]

            def on_update(sequence: Sequence, text: str) -> None:  # on the scheduler's thread
                start, end = reported[0], len(sequence.token_ids)
                reported[0] = end
                service.outbox.append((updates, (index, text, sequence.finish_reason, (start, end))))

            return on_update

        try:
            for ids, choices in zip(plan.prompts, plan.params):
                for params in choices:
                    sequences.append(service.scheduler.submit(ids, params, relay(len(sequences))))
        except QueueFull as e:
            cancel(sequences)
            raise ApiError(503, f"the server is busy: {e}", code="server_busy", kind="server_error") from None
        except RequestError as e:
            cancel(sequences)
            raise bad(e) from None
        reply = Reply(service.model_name, plan, sequences, service.tokenizer)
        request.state.reply = reply
        if plan.stream:
            return StreamingResponse(stream(updates, reply, plan.include_usage), media_type="text/event-stream")
        finished = 0

        async def all_finished():
            nonlocal finished
            while finished < len(sequences):
                _, _, reason, _ = await updates.get()
                finished += reason is not None

        work = asyncio.ensure_future(all_finished())
        watcher = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            watcher.cancel()
            cancel(sequences)  # a no-op for finished ones; frees the rows of a client that left
        if not work.done() or work.cancelled():
            return None  # the client left: nobody to answer
        failed = next((s for s in sequences if s.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error}", kind="server_error")
        return reply.whole()

    async def stream(updates: asyncio.Queue, reply: Reply, include_usage: bool):
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
                        events.append("data: " + json.dumps(error.body()) + "\n\n")
                    else:
                        events.append(reply.event(index, text, reason, tokens, first=index not in started))
                        started.add(index)
                yield "".join(events)
            if include_usage:
                yield reply.usage_event()
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: Starlette cancels this generator
            cancel(reply.sequences)

    return app


async def disconnected(request: Request) -> None:
    """Return when the client has gone (the ASGI server's http.disconnect, which arrives as soon as
    the connection closes: the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, update in items:
        queue.put_nowait(update)


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def cancel(sequences: list[Sequence]) -> None:
    for sequence in sequences:
        sequence.cancelled = True
