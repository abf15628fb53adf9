"""What clients send (OpenAI's chat and text completions) and what they get back.

Fields OpenAI defines that this server does not compute yet are refused by name (a 400 that says so), never
ignored: a client that asks for tools must not get an answer without them. A field OpenAI does not define is refused
too (a typo is named). ``response_format`` is computed: a JSON schema (or any JSON object) constrains the answer.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from exporters.server.errors import ApiError
from exporters.server.logprobs import MOST_CHAT, MOST_COMPLETIONS
from exporters.server.tools import HERMES, Tool, ToolCalls, ToolChoice, tool_calls

#: The recordings input_audio takes (what libsndfile reads).
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")

#: OpenAI's fields the server refuses for now, with what to do instead; a value that asks nothing (null, false, 0,
#: n=1) is accepted.
NOT_YET = {
    "logit_bias": "logit_bias is not applied by this server",
    "presence_penalty": "penalties are not applied by this server; leave presence_penalty at 0",
    "frequency_penalty": "penalties are not applied by this server; leave frequency_penalty at 0",
    "best_of": "best_of is not supported; send one request per answer",
    "echo": "echo is not supported",
    "suffix": "suffix (fill-in-the-middle) is not supported",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    user: Optional[str] = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    def check(self) -> None:
        """Refuse what is asked and not computed (NOT_YET), n > 1, more than 4 stop strings, log-probabilities asked
        in the other API's shape."""
        self.wanted_logprobs()
        for name, why in NOT_YET.items():
            value = getattr(self, name, None)
            if value not in (None, False, 0, [], {}):
                raise ApiError(400, f"{name}: {why}.", param=name, code="unsupported_parameter")
        if self.n != 1:
            raise ApiError(400, f"n={self.n}: this server gives one answer per request (n=1); send n requests.",
                           param="n", code="unsupported_parameter")
        if len(self.stops) > 4:
            raise ApiError(400, f"stop holds {len(self.stops)} strings; at most 4.", param="stop")
        self.json_schema()

    def json_schema(self) -> tuple[bool, dict[str, Any] | None]:
        """``(constrained, schema)`` from ``response_format``: ``text`` (or none) is not constrained; ``json_object``
        is any JSON object (schema None); ``json_schema`` is its ``json_schema.schema``. Refused when malformed."""
        form = self.response_format
        if form is None or form.get("type") == "text":
            return False, None
        kind = form.get("type")
        if kind == "json_object":
            return True, None
        if kind != "json_schema":
            raise ApiError(400, f"response_format.type={kind!r}: one of 'text', 'json_object' and 'json_schema'.",
                           param="response_format.type")
        spec = form.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, the JSON schema as an object "
                           "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}).",
                           param="response_format.json_schema")
        return True, spec["schema"]

    def wanted_logprobs(self) -> int | None:
        """Alternatives per token to report with log-probabilities (0: the chosen token's alone); None: none."""
        raise NotImplementedError

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None
    image_url: Optional[dict[str, Any]] = None
    input_audio: Optional[dict[str, Any]] = None

    def picture(self, where: str) -> bytes:
        """An ``image_url`` part's bytes: a ``data:`` URL (base64); the server fetches nothing."""
        url = (self.image_url or {}).get("url")
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ApiError(400, f"{where}: an image_url is taken as a data URL (data:image/png;base64,...); this server "
                           "fetches nothing from the network.", param=where, code="unsupported_content")
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ApiError(400, f"{where}: the data URL is not base64 (data:image/png;base64,...).", param=where)
        try:
            return base64.b64decode(payload, validate=True)
        except ValueError:
            raise ApiError(400, f"{where}: the data URL's base64 does not decode.", param=where) from None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool's result: the call it answers

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "image_url" for part in self.content)

    @property
    def has_audio(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "input_audio" for part in self.content)

    def recording(self, index: int) -> tuple[bytes, str, str, list[bytes]]:
        """The one ``input_audio`` part's bytes and format, the text beside it, and the pictures of the image_url
        parts beside it (for a program that also sees: Gemma 4), in order."""
        where = f"messages[{index}].content"
        audio = [part for part in self.content or [] if isinstance(part, ContentPart) and part.type == "input_audio"]
        if len(audio) != 1:
            raise ApiError(400, f"{where}: {len(audio)} input_audio parts; a prompt takes one recording.", param=where)
        given = audio[0].input_audio or {}
        fmt = given.get("format")
        if fmt not in AUDIO_FORMATS:
            raise ApiError(400, f"{where}: input_audio.format={fmt!r}: one of {', '.join(AUDIO_FORMATS)}.", param=where)
        try:
            data = base64.b64decode(str(given.get("data", "")), validate=True)
        except ValueError:
            raise ApiError(400, f"{where}: input_audio.data is not base64.", param=where) from None
        others = [part.type for part in self.content if part.type not in ("input_audio", "text", "image_url")]  # type: ignore[union-attr]
        if others:
            raise ApiError(400, f"{where}: a {others[0]} part beside the recording: this server takes text, "
                           "image_url and one input_audio part.", param=where, code="unsupported_content")
        pictures = [part.picture(f"{where}[{i}]") for i, part in enumerate(self.content)  # type: ignore[union-attr]
                    if part.type == "image_url"]
        return data, fmt, "".join(part.text or "" for part in self.content if part.type == "text"), pictures  # type: ignore[union-attr]

    def text(self, index: int) -> str:
        """The message's text; a part that is not text (an image, audio) is refused with what takes it."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                what = ("this program takes text only (images go to a vision-language program)"
                        if part.type == "image_url" else "this program takes no audio (recordings go to an "
                        "audio-language program)" if part.type == "input_audio" else
                        "this server takes text, image_url and input_audio parts")
                raise ApiError(400, f"messages[{index}]: a content part of type {part.type!r}: {what}.",
                               param=f"messages[{index}].content", code="unsupported_content")
        return "".join(part.text or "" for part in self.content)

    def parts(self, index: int) -> tuple[list[dict[str, Any]], list[bytes]]:
        """The content as a processor's chat template takes it (text parts, and ``{"type": "image"}`` where each
        picture goes), and the pictures' bytes in order."""
        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content or ""}], []
        parts: list[dict[str, Any]] = []
        pictures: list[bytes] = []
        for i, part in enumerate(self.content):
            if part.type == "image_url":
                pictures.append(part.picture(f"messages[{index}].content[{i}]"))
                parts.append({"type": "image"})
            elif part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            else:
                raise ApiError(400, f"messages[{index}]: a content part of type {part.type!r}: this server takes text "
                               "and image_url parts.", param=f"messages[{index}].content", code="unsupported_content")
        return parts, pictures


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Optional[bool] = None

    def check(self) -> None:
        super().check()
        if self.tool_calls() is not None and self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "tools with response_format: a tool call is constrained to its arguments already; "
                           "give one of them.", param="response_format")

    def tool_calls(self, tags: tuple[str, str] | None = HERMES) -> ToolCalls | None:
        """What the tools ask of the answer, the model writing calls between ``tags`` (its template's syntax)."""
        return tool_calls(self.tools, self.tool_choice, self.parallel_tool_calls, tags)

    def wanted_logprobs(self) -> int | None:
        """Chat's shape: ``logprobs`` true or false, ``top_logprobs`` 0 to 20 alternatives beside it."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ApiError(400, f"logprobs={self.logprobs}: a chat completion takes logprobs=true and the number of "
                           f"alternatives as top_logprobs (0 to {MOST_CHAT}).", param="logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MOST_CHAT:
            raise ApiError(400, f"top_logprobs={self.top_logprobs}: 0 to {MOST_CHAT}.", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def most_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: Union[str, list[str]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for text completions

    def wanted_logprobs(self) -> int | None:
        """Text completions' shape: ``logprobs`` is the number of alternatives (0 to 5)."""
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is a chat completion's field; a text completion takes the number of "
                           f"alternatives as logprobs (0 to {MOST_COMPLETIONS}).", param="top_logprobs")
        if isinstance(self.logprobs, bool) or (self.logprobs is not None
                                               and not 0 <= self.logprobs <= MOST_COMPLETIONS):
            raise ApiError(400, f"logprobs={str(self.logprobs).lower()}: a text completion takes the number of "
                           f"alternatives per token, 0 to {MOST_COMPLETIONS}.", param="logprobs")
        return self.logprobs

    @property
    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, f"prompt holds {len(self.prompt)} prompts: this server answers one per request.",
                           param="prompt", code="unsupported_parameter")
        return self.prompt[0]

    @property
    def most_tokens(self) -> Optional[int]:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "tool_calls"]


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
