"""The HTTP side: OpenAI's routes over an :class:`~exporters.server.engine.Engine` (FastAPI, served by uvicorn).

Generation runs in the engine's one thread; a request waits for it without holding the event loop, a stream gets
its text as the thread releases it (server-sent events), and a client that disconnects stops its generation at the
next token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from exporters.runtime.generator import SamplingConfig
from exporters.runtime.media import MediaPrompt
from exporters.server.engine import Answer, Cancelled, Engine, Job, random_seed
from exporters.server.errors import ApiError
from exporters.server.logprobs import chat_logprobs, completion_logprobs
from exporters.server.protocol import ChatRequest, CompletionRequest, Sampling, new_id, now, usage
from exporters.server.tools import ToolCalls, template_message, template_tools


@dataclass(frozen=True)
class Limits:
    """What one request may ask: ``max_tokens`` to generate, ``max_body`` bytes of JSON."""

    max_tokens: int
    max_body: int
    api_key: str | None = None


def create_app(engine: Engine, limits: Limits, name: str) -> FastAPI:
    """The app serving ``engine``'s program as model ``name`` (and each adapter by its own name)."""
    app = FastAPI(title="llm-exporters", docs_url=None, redoc_url=None)
    _errors(app)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable) -> Any:
        try:
            _authorize(request, limits.api_key)
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > limits.max_body:
                raise ApiError(413, f"the request is {size} bytes, above this server's {limits.max_body} "
                               "(max_request_bytes=).", code="request_too_large")
        except ApiError as e:
            return _error(e)
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        ids = [name, *engine.models]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "llm-exporters"}
                                           for i in ids]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        body.check()  # before the template: what is asked is refused whatever the program has
        if any(m.has_audio for m in body.messages):
            if len(body.messages) != 1 or body.messages[0].role != "user" or body.tools:
                raise ApiError(400, "a chat with input_audio takes one user message (the recording and the text about "
                               "it), without tools, for now.", param="messages")
            data, fmt, text, pictures = body.messages[0].recording(0)
            media = await asyncio.get_running_loop().run_in_executor(None, engine.audio_prompt, data, fmt, text,
                                                                     pictures)
            return await _complete(engine, limits, body, media, request, name, chat=True)
        if any(m.has_images for m in body.messages) and engine.generator.sees_images:
            if body.tools:
                raise ApiError(400, "tools beside images: a chat with images goes through the processor's template, "
                               "which is given no tools here yet; send them in separate requests.", param="tools")
            conversation, pictures = [], []
            for i, m in enumerate(body.messages):
                parts, found = m.parts(i)
                conversation.append({"role": m.role, "content": parts})
                pictures += found
            media = await asyncio.get_running_loop().run_in_executor(None, engine.image_prompt, conversation, pictures)
            return await _complete(engine, limits, body, media, request, name, chat=True)
        messages = [template_message(m.role, m.text(i), m.tool_calls, m.tool_call_id)
                    for i, m in enumerate(body.messages)]
        tools = body.tool_calls(engine.template.call_tags)
        prompt = engine.template.render(messages, template_tools(body.tools))
        return await _complete(engine, limits, body, prompt, request, name, chat=True, tools=tools)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        body.check()
        return await _complete(engine, limits, body, body.text, request, name, chat=False)

    return app


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(401, "a missing or wrong API key: send Authorization: Bearer <the key given to "
                       "exporters.serve with api_key=>.", code="invalid_api_key")


async def _complete(engine: Engine, limits: Limits, body: Sampling, prompt: str | MediaPrompt, request: Request,
                    name: str, chat: bool, tools: ToolCalls | None = None) -> Any:
    """``body`` checked (``Sampling.check``) and ``prompt`` rendered by the route (text, or a prompt with images);
    ``tools``: the answer is a tool call, constrained to it."""
    adapter = _adapter(engine, body.model, name)
    wanted = body.most_tokens  # type: ignore[attr-defined]
    if wanted is not None and wanted > limits.max_tokens:
        raise ApiError(400, f"max_tokens={wanted} is above this server's limit of {limits.max_tokens} "
                       "(max_tokens= when it was started).", param="max_tokens")
    media = prompt if isinstance(prompt, MediaPrompt) else None
    ids = media.ids if media is not None else engine.prompt_ids(prompt)
    constrained, schema = body.json_schema()
    loop = asyncio.get_running_loop()
    constraint = (await loop.run_in_executor(None, engine.tool_constraint, tools) if tools is not None else
                  await loop.run_in_executor(None, engine.constraint, schema) if constrained else None)
    sampling = SamplingConfig(wanted or limits.max_tokens, body.temperature, body.top_p,
                              random_seed() if body.seed is None else body.seed)
    engine.admit()  # released when the job ends, whether or not its client is still there
    job = Job(adapter, ids, sampling, body.stops, top_logprobs=body.wanted_logprobs(), constraint=constraint,
              media=media)
    reply = _Reply(body.model, chat, engine.token_text, tools)
    if body.stream:
        pieces: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if tools is None:  # a call's JSON is not streamed as text: its tool_calls come whole at the end
            job.on_text = lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece)
        future = _submit(engine, job, request, lambda: pieces.put_nowait(None))
        return StreamingResponse(_stream(future, pieces, job, reply, body.usage_in_stream),
                                 media_type="text/event-stream")
    return reply.whole(await _submit(engine, job, request))


def _submit(engine: Engine, job: Job, request: Request, then: Callable[[], None] = lambda: None) -> asyncio.Future:
    """``job`` queued for the engine's thread, its client watched (one that disconnects cancels it: generation stops
    at the next token); when it ends, its place in the queue is given back and ``then`` runs (in the event loop),
    even if its client left before its response started."""
    future = asyncio.get_running_loop().run_in_executor(engine.worker, engine.run, job)
    watcher = asyncio.create_task(_watch(request, job))

    def ended(f: asyncio.Future) -> None:
        watcher.cancel()
        engine.leave()
        if not f.cancelled():
            f.exception()  # read here, so that a job nobody awaits any more is not reported as unread
        then()

    future.add_done_callback(ended)
    return future


def _adapter(engine: Engine, model: str, name: str) -> str | None:
    if model == name:
        return None
    if model in engine.models:
        return model
    raise ApiError(404, f"model {model!r} is not served here: {', '.join([name, *engine.models])} "
                   "(GET /v1/models lists them).", param="model", code="model_not_found")


async def _watch(request: Request, job: Job) -> None:
    """Cancel ``job`` when its client disconnects (polled: a stream only learns it at its next write)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
    job.cancelled.set()


async def _stream(future: asyncio.Future, pieces: asyncio.Queue, job: Job, reply: "_Reply",
                  with_usage: bool) -> AsyncIterator[str]:
    try:
        yield _event(reply.chunk(role=True))
        while (piece := await pieces.get()) is not None:
            yield _event(reply.chunk(piece))
        answer = future.result()
        content, calls = reply.split(answer) if reply.tools is not None else (None, [])
        if content:  # held back while a call could still come (tools): the text around the calls
            yield _event(reply.chunk(content))
        if calls:
            yield _event(reply.chunk(calls=calls))
        # Text is released in pieces that are not tokens (bytes merge, stop strings hold text back): the tokens'
        # log-probabilities come whole with the last chunk, which the client appends as it does any chunk's.
        yield _event(reply.chunk(finish=reply.finish(answer), logprobs=reply.logprobs(answer)))
        if with_usage:
            yield _event(reply.usage_chunk(answer))
        yield "data: [DONE]\n\n"
    except Cancelled:
        pass
    except ApiError as e:  # after the response started: the error goes in the stream
        yield _event(e.body())
    finally:
        job.cancelled.set()  # a client gone mid-stream: generation stops at its next token


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Reply:
    """OpenAI's response objects for one request."""

    def __init__(self, model: str, chat: bool, text_of: Callable[[int], str], tools: ToolCalls | None = None) -> None:
        self.model, self.chat, self.text_of, self.tools = model, chat, text_of, tools
        self._split: tuple[str | None, list[dict[str, Any]]] | None = None
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()

    def split(self, answer: Answer) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's content and tool calls (none unless it ended by itself: one cut by max_tokens stays text,
        finish_reason length). Computed once: a call's id is made here."""
        if self._split is None:  # one reply is one answer
            whole = self.tools is not None and answer.finish_reason == "stop"
            self._split = self.tools.split(answer.text) if whole and self.tools else (answer.text, [])
        return self._split

    def finish(self, answer: Answer) -> str:
        return "tool_calls" if self.split(answer)[1] else answer.finish_reason

    def logprobs(self, answer: Answer) -> dict[str, Any] | None:
        if answer.logprobs is None:
            return None
        shape = chat_logprobs if self.chat else completion_logprobs
        return shape(answer.logprobs, self.text_of)

    def _head(self, suffix: str = "") -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + suffix, "created": self.created, "model": self.model}

    def whole(self, answer: Answer) -> dict[str, Any]:
        content, calls = self.split(answer)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish(answer), "logprobs": self.logprobs(answer)}
        if self.chat and calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        return {**self._head(), "choices": [choice], "usage": _usage(answer)}

    def chunk(self, text: str = "", role: bool = False, finish: str | None = None,
              logprobs: dict[str, Any] | None = None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
            if calls:
                delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return {**self._head(".chunk"), "choices": [choice]}
        return {**self._head(), "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

    def usage_chunk(self, answer: Answer) -> dict[str, Any]:
        return {**self._head(".chunk" if self.chat else ""), "choices": [], "usage": _usage(answer)}


def _usage(answer: Answer) -> dict[str, Any]:
    return usage(answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _errors(app: FastAPI) -> None:
    """Every refusal as OpenAI's JSON error: ours, a body that does not parse or validate, an unknown route."""

    @app.exception_handler(ApiError)
    async def refused(_: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return _error(ApiError(400, f"the body is not valid JSON ({first.get('msg')}).", code="invalid_json"))
        if first.get("type") == "extra_forbidden":
            return _error(ApiError(400, f"{where}: not a field of this request (a typo?).", param=where,
                                   code="unknown_parameter"))
        return _error(ApiError(400, f"{where or 'body'}: {first.get('msg')}.", param=where or None))

    @app.exception_handler(Exception)
    async def failed(_: Request, e: Exception) -> JSONResponse:  # a bug of ours: said, and the server goes on
        return _error(ApiError(500, f"the server failed on this request ({type(e).__name__}: {e}); it goes on "
                               "serving. Please report it with the request.", code="server_error"))

    @app.exception_handler(HTTPException)
    async def http(_: Request, e: HTTPException) -> JSONResponse:
        return _error(ApiError(e.status_code, f"{e.detail}: this server answers GET /v1/models, POST "
                               "/v1/chat/completions and POST /v1/completions.", code="not_found"
                               if e.status_code == 404 else None))
