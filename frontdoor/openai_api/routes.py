"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`.

So that the tools that speak OpenAI's HTTP API (the `openai` SDK, LangChain, LiteLLM, evaluation
harnesses, genai-perf's `openai` endpoint type) can use the server. Every prompt becomes one
request to Triton through the batchstring client, over gRPC on Triton's private socket: Triton's
dynamic batcher, queue policy and the engine see exactly what a `batchstring` call sends, and a
list of prompts in one completion request *is* a `batchstring` call.

What OpenAI's API has and the engine does not (best_of, suffix, tools, prompts as token ids) is
refused with a 400 naming the field, never silently ignored; a field that changes what is
generated is honoured or refused, never dropped (`response_format`, vLLM's `structured_outputs`
and `guided_*` become the engine's structured-output constraint); fields this API does not know
and that change nothing (`user`) are ignored, as OpenAI's own server does.

`n` > 1 sends each prompt n times in one call: the copies reach the engine together, so the
prefix cache computes the prompt once and the others reuse its blocks. Choice i * n + j is the
j-th completion of prompt i, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from batchstring.client import AsyncBatchClient, Completion, InvalidArgument
from batchstring.client import openai_format as fmt
from batchstring.client.protocol import Piece
from batchstring.frontdoor.gateway.auth import ApiKeys
from batchstring.frontdoor.gateway.tenants import cache_salt, owner
from batchstring.frontdoor.openai_api.adapters import AdapterNames
from batchstring.frontdoor.openai_api.chat import ChatTemplate

MAX_PROMPTS = 256  # prompts in one completion request (each is one request to Triton)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def of(cls, index: int, exc: BaseException, many: bool) -> ApiError:
        """The HTTP error for a failed prompt; in a list, which prompt it was."""
        status, code, message = fmt.failure(exc)
        return cls(status, f"prompt[{index}]: {message}" if many else message, code=code)

    def response(self) -> web.Response:
        return error_response(self.status, str(self), self.param, self.code)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(fmt.error_body(status, message, param, code), status=status)


@dataclass(frozen=True)
class Request:
    """One completion or chat request, validated: prompts and the client's sampling options."""

    prompts: list[str]  # each prompt n times in a row (n choices)
    options: dict
    stream: bool
    include_usage: bool
    echo: bool
    chat: bool
    n: int = 1

    def options_for(self, index: int) -> dict:
        """Completion `index`'s options: with a seed, choice j of a prompt samples from seed + j (as
        vLLM derives its n sequences' generators), so that n seeded choices differ from each other
        and repeat exactly on every run; choice 0 is the same request with n = 1."""
        choice = index % self.n
        if not choice or self.options.get("seed") is None:
            return self.options
        return {**self.options, "seed": self.options["seed"] + choice}


class OpenAIRoutes:
    def __init__(self, client: AsyncBatchClient, model_name: str, chat: ChatTemplate | None,
                 keys: ApiKeys | None = None, adapters: AdapterNames | None = None) -> None:
        self.client = client
        self.model_name = model_name
        self.chat = chat
        self.keys = keys or ApiKeys([])
        self.adapters = adapters or AdapterNames()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)

    # ----- routes ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "batchstring"}
        adapters = [{**card, "id": name, "root": name, "parent": self.model_name} for name in self.adapters()]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            parsed = self.parse(await json_body(request), chat)
            # the caller's key salts its cached prefixes: no other key can reuse or time them
            parsed.options["cache_salt"] = cache_salt(owner(request, self.keys), parsed.options["cache_salt"])
            if parsed.stream:
                return await self._stream(request, parsed)
            return web.json_response(self._body(parsed, await _complete(self.client, parsed)))
        except ApiError as exc:
            return exc.response()
        except InvalidArgument as exc:  # text the client refuses to send (lone surrogates)
            return error_response(400, exc.message, "prompt", "invalid_value")

    # ----- request -----------------------------------------------------------------------------

    def parse(self, body: dict, chat: bool) -> Request:
        """A completion or chat body, validated (the /v1 routes and the Batch API's lines read it alike)."""
        model = body.get("model")
        adapters = [] if model == self.model_name else self.adapters()
        if model != self.model_name and model not in adapters:
            served = ", ".join(repr(name) for name in [self.model_name, *adapters])
            raise ApiError(404, f"model {model!r} does not exist here; this server serves {served} "
                                "(GET /v1/models)", "model", "model_not_found")
        try:
            n = fmt.choices_per_prompt(body)
            sampling = fmt.sampling_options({k: v for k, v in body.items() if k != "n"}, chat)
        except fmt.BodyError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        prompts = [self._chat_prompt(body.get("messages"))] if chat else _prompts(body.get("prompt"))
        if len(prompts) * n > MAX_PROMPTS:
            raise ApiError(400, f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} completions; at most "
                                f"{MAX_PROMPTS} per request", "n")
        prompts = [p for p in prompts for _ in range(n)]
        # OpenAI's defaults: 16 tokens for completions (chat: the model's), temperature 1
        options = {"max_tokens": None if chat else 16, "temperature": 1.0, **sampling,
                   "cache_salt": body.get("cache_salt"), "adapter": None if model == self.model_name else model}
        if not isinstance(options["cache_salt"], str | None):
            raise ApiError(400, "cache_salt must be a string", "cache_salt")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream must be true or false; got {stream!r}", "stream")
        usage = (body.get("stream_options") or {}).get("include_usage", False)
        echo = bool(body.get("echo", False)) and not chat
        return Request(prompts, options, stream, bool(usage), echo, chat, n)

    def _chat_prompt(self, messages) -> str:
        if self.chat is None:
            raise ApiError(400, "this model has no chat template, so it has no chat route: use /v1/completions, "
                                "or export a checkpoint whose tokenizer config has a chat_template", "messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string role", "messages")
            plain.append({"role": m["role"], "content": _content(m.get("content"), i)})
        try:
            return self.chat.render(plain)
        except Exception as exc:  # the template's own raise_exception(), or a template error
            raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None

    # ----- response ----------------------------------------------------------------------------

    def _body(self, req: Request, results: list[Completion | BaseException]) -> dict:
        failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failures:
            raise ApiError.of(*failures[0], many=len(results) > 1)
        return fmt.completion(self._model(req), results, req.chat, req.prompts if req.echo else None)

    def _model(self, req: Request) -> str:
        """The model a response names: the adapter the request chose, or the base model."""
        return req.options.get("adapter") or self.model_name

    async def _stream(self, request: web.Request, req: Request) -> web.StreamResponse:
        """Server-sent events, one per generated piece of any prompt, then usage and [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = fmt.head(self._model(req), req.chat)
        if req.chat:  # a streamed chat answer comes in chunks of its own kind
            head["object"] = "chat.completion.chunk"
        usage = []
        try:
            async for index, piece in _merged(self.client, req):
                if isinstance(piece, BaseException):
                    error = ApiError.of(index, piece, many=len(req.prompts) > 1)
                    await _event(response, fmt.error_body(error.status, str(error), code=error.code))
                    break
                await _event(response, {**head, "choices": [self._delta(req, index, piece)]})
                if piece.final:
                    usage.append(Completion.join([piece]))
            else:
                if req.include_usage:
                    await _event(response, {**head, "choices": [], "usage": fmt.usage(usage)})
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the caller left: _merged's cancellation stops the requests
            return response
        await response.write_eof()
        return response

    def _delta(self, req: Request, index: int, piece: Piece) -> dict:
        lp = fmt.logprobs(piece.logprobs, req.chat)
        reason = piece.finish_reason or None if piece.final else None
        if req.chat:
            return {"index": index, "delta": {"role": "assistant", "content": piece.text}, "logprobs": lp,
                    "finish_reason": reason}
        return {"index": index, "text": piece.text, "logprobs": lp, "finish_reason": reason}


async def _complete(client: AsyncBatchClient, req: Request) -> list[Completion | BaseException]:
    """Every completion, in order: one call (the copies of a prompt reach the engine together, and
    the prefix cache computes it once), or with a seed one call per choice index (their seeds
    differ), all at once."""
    if req.options.get("seed") is None or req.n == 1:
        return await client.complete(req.prompts, **req.options, return_exceptions=True)
    calls = [client.complete(req.prompts[j :: req.n], **req.options_for(j), return_exceptions=True)
             for j in range(req.n)]
    by_choice = await asyncio.gather(*calls)
    return [by_choice[i % req.n][i // req.n] for i in range(len(req.prompts))]


async def _merged(client: AsyncBatchClient, req: Request) -> AsyncIterator[tuple[int, Piece | BaseException]]:
    """Every prompt's pieces as they come, tagged with its index; an error ends that prompt."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prompt: str) -> None:
        try:
            if req.echo:
                await queue.put((index, Piece("", text=prompt)))
            async for piece in client.stream_pieces(prompt, **req.options_for(index)):
                await queue.put((index, piece))
        except Exception as exc:  # reported to the caller as an error event
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(req.prompts)]
    open_ = len(tasks)
    try:
        while open_:
            index, item = await queue.get()
            if item is None:
                open_ -= 1
            else:
                yield index, item
    finally:
        for task in tasks:  # the caller left or an error ended the stream: stop the rest
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _event(response: web.StreamResponse, data: dict) -> None:
    await response.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")


async def json_body(request: web.Request) -> dict:
    """A request's JSON object, or a 400 that says what it was instead."""
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    return body


def _prompts(prompt) -> list[str]:
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "prompt must be a string or a non-empty list of strings (prompts as token ids "
                            "are not supported: send text)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt is a list of {len(prompts)} strings; at most {MAX_PROMPTS} per request "
                            "(send several requests, or use `batchstring run --input` for files)", "prompt")
    return prompts


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts (this model reads "
                        "text only)", "messages")
