"""`moemesh serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the
scheduler, so that the official `openai` client works unchanged.

    GET  /health                 200 while serving (no key needed)
    GET  /v1/models              the one model
    POST /v1/completions         prompt: a string or a list of strings (one choice each)
    POST /v1/chat/completions    for tokenizers with a chat template (chat.py); else 400

Both POSTs take max_tokens (default 16), temperature (default 1, as OpenAI's), top_p, seed
(default: a random one), stop (a string or a list), n (only 1) and stream: server-sent events,
one chunk per token (with the text that became final, maybe ""), ending in `data: [DONE]`; with
stream_options.include_usage a last chunk carries the usage. Requests run in the scheduler's thread,
batched continuously; the HTTP side only queues them and relays their text.

Bad requests get OpenAI's error object {"error": {"message", "type", "param", "code"}} and the
server carries on: 400 for bad JSON or fields (a missing or non-string prompt, max_tokens < 1 or
beyond the context with the prompt, temperature < 0, top_p outside (0, 1], a prompt longer than
the context), 401 without the API key (when one is set), 404 for another model's name, 413 for a
body over the limit, 503 when the waiting queue is full. A client that disconnects cancels its
requests, whose rows free at the next step.

Limits: text prompts only (no token-id prompts, logprobs, echo, best_of, suffix or tools).
This module needs fastapi and uvicorn (`pip install moemesh[serve]`); nothing else imports it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import RequestError
from moemesh.inference.chat import ChatTemplate, load_chat_template
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.generate import prompt_ids
from moemesh.inference.request import SamplingParams, Sequence
from moemesh.inference.scheduler import QueueFull, Scheduler


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_request_bytes = api_key, max_request_bytes
        self.scheduler = Scheduler(engine, tokenizer, max_waiting)
        self.chat_template: ChatTemplate | None = load_chat_template(tokenizer)
        self.chat_stop_ids: tuple[int, ...] = ()
        if self.chat_template is not None and self.chat_template.eos_token:
            ids = tokenizer.encode(self.chat_template.eos_token)
            self.chat_stop_ids = tuple(ids) if len(ids) == 1 else ()
        self.created = int(time.time())
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
                f"moemesh serve: decode steps of batch 1 to {self.engine.max_batch} ready in {seconds:.1f} s",
                flush=True,
            )
        worker = threading.Thread(target=self.scheduler.serve_forever, name="moemesh-scheduler", daemon=True)
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

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def serve(
    engine: DecodeEngine, tokenizer: Tokenizer, host: str = "127.0.0.1", port: int = 8000, sock=None, **settings
) -> None:
    """Serve until interrupted (on `sock` when given, bound to host:port); then release the other
    ranks of a tensor-parallel group."""
    try:
        Service(engine, tokenizer, **settings).serve(host, port, sock, announce=True)
    finally:
        engine.close()


# ---- reading requests ------------------------------------------------------------------------------


def _params(body: dict, prompt_tokens: int, context: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    def field(name, default, types):
        value = body.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            raise ApiError(400, f"{name} has the wrong type ({type(value).__name__})", name)
        return value

    stop = field("stop", (), (str, list, tuple))
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    seed = body.get("seed")
    params = SamplingParams(
        max_tokens=field("max_tokens", 16, (int,)),
        temperature=field("temperature", 1.0, (int, float)),
        top_p=field("top_p", 1.0, (int, float)),
        seed=secrets.randbits(31) if seed is None else seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
    )
    if field("n", 1, (int,)) != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    try:
        params.check()
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None
    if prompt_tokens >= context:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; the context holds {context}",
            "prompt",
            "context_length_exceeded",
        )
    if prompt_tokens + params.max_tokens > context:
        raise ApiError(
            400,
            f"max_tokens ({params.max_tokens}) and the prompt ({prompt_tokens} tokens) exceed the "
            f"context ({context} tokens)",
            "max_tokens",
            "context_length_exceeded",
        )
    return params


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string role", "messages")
        content = message.get("content", "")
        if isinstance(content, list):  # parts: only text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(400, "message content parts must be text", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "message content must be a string", "messages")
        out.append({"role": message["role"], "content": content})
    return out


# ---- the app ---------------------------------------------------------------------------------------


def _create_app(service: Service) -> FastAPI:
    app = FastAPI(title="moemesh", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):  # unknown paths and methods, in OpenAI's shape
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {service.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > service.max_request_bytes:
            raise ApiError(413, f"the request body is over {service.max_request_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > service.max_request_bytes:
                raise ApiError(
                    413, f"the request body is over {service.max_request_bytes} bytes", code="request_too_large"
                )
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = data.get("model", service.model_name)
        if model != service.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server has {service.model_name!r}",
                "model",
                "model_not_found",
            )
        return data

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {
            "object": "list",
            "data": [{"id": service.model_name, "object": "model", "created": service.created, "owned_by": "moemesh"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = await read_json(request)
        prompts = body.get("prompt")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ApiError(400, "prompt must be a string or a non-empty list of strings", "prompt")
        try:
            ids = [prompt_ids(service.tokenizer, p) for p in prompts]
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
        params = [_params(body, len(i), service.engine.max_len) for i in ids]
        return await respond(request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = await read_json(request)
        if service.chat_template is None:
            raise ApiError(
                400,
                "this model's tokenizer has no chat template (chat_template in tokenizer_config.json "
                "or chat_template.jinja beside tokenizer.json): use /v1/completions",
                "messages",
            )
        text = service.chat_template.render(_messages(body))
        ids = service.tokenizer.encode(text)
        return await respond(
            request, body, [ids], [_params(body, len(ids), service.engine.max_len, service.chat_stop_ids)], chat=True
        )

    async def respond(request: Request, body: dict, ids: list[list[int]], params: list[SamplingParams], chat: bool):
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        sequences: list[Sequence] = []

        def relay(index: int):
            def on_update(sequence: Sequence, text: str) -> None:  # on the scheduler's thread
                loop.call_soon_threadsafe(updates.put_nowait, (index, text, sequence.finish_reason))

            return on_update

        try:
            for index, (prompt, settings) in enumerate(zip(ids, params)):
                sequences.append(service.scheduler.submit(prompt, settings, relay(index)))
        except QueueFull as e:
            cancel(sequences)
            raise ApiError(503, f"the server is busy: {e}", code="server_busy", kind="server_error") from None
        except RequestError as e:
            cancel(sequences)
            raise ApiError(400, str(e), e.param) from None
        reply = _Reply(service.model_name, chat, sequences)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(updates, reply, include_usage), media_type="text/event-stream")
        try:
            finished = 0
            while finished < len(sequences):
                try:
                    _, _, reason = await asyncio.wait_for(updates.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                finished += reason is not None
        finally:
            cancel(sequences)  # a no-op for finished ones; frees the rows of a client that left
        failed = next((s for s in sequences if s.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error}", kind="server_error")
        return reply.whole()

    async def stream(updates: asyncio.Queue, reply: _Reply, include_usage: bool):
        try:
            if reply.chat:
                yield reply.event(0, None, None, first=True)
            finished = 0
            while finished < len(reply.sequences):
                index, text, reason = await updates.get()
                finished += reason is not None
                if reason == "error":
                    yield "data: " + json.dumps(ApiError(500, "generation failed", kind="server_error").body()) + "\n\n"
                else:
                    yield reply.event(index, text, reason)
            if include_usage:
                yield reply.usage_event()
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: Starlette cancels this generator
            cancel(reply.sequences)

    return app


def cancel(sequences: list[Sequence]) -> None:
    for sequence in sequences:
        sequence.cancelled = True


class _Reply:
    """OpenAI's response objects for a request's sequences."""

    def __init__(self, model: str, chat: bool, sequences: list[Sequence]):
        self.model, self.chat, self.sequences = model, chat, sequences
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, int]:
        prompt = sum(len(s.prompt_ids) for s in self.sequences)
        completion = sum(len(s.token_ids) for s in self.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> dict:
        if self.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": s.text},
                    "finish_reason": s.finish_reason,
                    "logprobs": None,
                }
                for i, s in enumerate(self.sequences)
            ]
        else:
            choices = [
                {"index": i, "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}
                for i, s in enumerate(self.sequences)
            ]
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def event(self, index: int, text: str | None, reason: str | None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
        return "data: " + json.dumps({**self._head(True), "choices": [choice]}, ensure_ascii=False) + "\n\n"

    def usage_event(self) -> str:
        return "data: " + json.dumps({**self._head(True), "choices": [], "usage": self.usage()}) + "\n\n"
