"""One program, one request at a time: the queue in front of it, the chat template, and the cache kept across turns.

The program holds one KV cache. Its entries are written by position and no query attends past its own, so a prompt
that starts with the tokens already run (a chat's next turn) runs only the rest, as ``llama-server`` does. That holds
for attention over the whole cache; a ring (attention windows, an attention sink) overwrites old positions and
recurrent state (LFM2, Qwen3.5) cannot step back, so those programs run every prompt whole.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from exporters.errors import UserError
from exporters.manifest import MANIFEST_FILE, Manifest
from exporters.program.audio import AUDIO_METHOD
from exporters.runtime.constraint import Constraint
from exporters.runtime.generator import Generator, SamplingConfig, chat_template
from exporters.runtime.heard import audio_entry
from exporters.runtime.images import check_sees_images, conversation_prompt, open_picture
from exporters.runtime.media import MediaPrompt
from exporters.server.errors import ApiError
from exporters.server.logprobs import Recorder, TokenLogprob
from exporters.server.stops import StopText
from exporters.server.tools import HERMES, ToolCalls
from models.vision import load_processor


log = logging.getLogger("exporters.server")


class Cancelled(Exception):
    """The client went away: generation stops at the next token."""


class Stopped(Exception):
    """A stop string appeared: generation ends there."""


@dataclass
class Job:
    """One request, as the engine runs it."""

    model: str | None  # an adapter, or None: the base
    ids: list[int]
    sampling: SamplingConfig
    stops: list[str]
    on_text: Callable[[str], None] | None = None  # streaming: each piece of text as it is released
    cancelled: threading.Event = field(default_factory=threading.Event)
    top_logprobs: int | None = None  # log-probabilities with this many alternatives per token; None: none
    constraint: Constraint | None = None  # response_format: the grammar the answer follows
    media: MediaPrompt | None = None  # a prompt with images (its ids are ``ids``)


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, already in the cache
    finish_reason: Literal["stop", "length"]
    logprobs: list[TokenLogprob] | None = None  # one per completion token, when the job asked


def cache_reusable(pte: Path) -> str | None:
    """None when a prompt may reuse what the cache holds; else why not. Read from the manifest beside ``pte`` (a
    run's, or a bundle's: both record ``kv_cache``)."""
    try:
        cache = json.loads((pte.parent / MANIFEST_FILE).read_text()).get("kv_cache")
    except (OSError, ValueError):
        return "no manifest beside the program says what its cache is"
    if cache is None:
        return "the manifest does not record the cache"
    if cache.get("state_bytes"):
        return "its recurrent state cannot step back"
    if cache.get("attention_sink") or any(w is not None for w in cache.get("windows", [])):
        return "its ring cache overwrites old positions"
    return None


class ChatTemplate:
    """The chat template the export bundled, applied by transformers as the model's own tokenizer applies it."""

    def __init__(self, folder: Path) -> None:
        self.tokenizer = None
        if chat_template(folder):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    @property
    def call_tags(self) -> tuple[str, str] | None:
        """How the template has the model write a tool call in its text (Hermes' tags), or None."""
        source = getattr(self.tokenizer, "chat_template", None) or ""
        return HERMES if isinstance(source, str) and HERMES[0] in source else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if self.tokenizer is None:
            raise ApiError(400, "this program was exported without a chat template (chat_template.jinja or "
                           "tokenizer_config.json's chat_template beside it): use /v1/completions with the prompt "
                           "as the model expects it.", code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's own errors: a template that refuses this conversation (roles, order)
            raise ApiError(400, f"the model's chat template refused these messages: {e}", param="messages") from e


class Engine:
    """The loaded program and the one thread that runs it; at most ``max_queue`` requests wait beside the one
    running (more get HTTP 429). ``generator`` keeps its cache across requests where :func:`cache_reusable` allows."""

    def __init__(self, generator: Generator, max_queue: int, speculative: str = "auto") -> None:
        self.generator = generator
        self.template = ChatTemplate(generator.pte.parent)
        self.speculative = speculative
        self.max_queue = max_queue
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="program")
        self._admitted = 0
        self._lock = threading.Lock()
        self.models = generator.adapters  # read once: a swappable program's are files, listed at every request else
        self._processor = None  # a vision-language program's, loaded at its first request with images
        self._processor_lock = threading.Lock()
        folder = generator.pte.parent
        self._audio = audio_entry(Manifest.read(folder)) if (folder / MANIFEST_FILE).is_file() else None

    def admit(self) -> None:
        """Take a place in the queue, or refuse with 429."""
        with self._lock:
            if self._admitted > self.max_queue:
                raise ApiError(429, f"the server is busy: one request runs and {self.max_queue} wait. Retry after a "
                               "second.", code="queue_full", retry_after=1)
            self._admitted += 1

    def leave(self) -> None:
        with self._lock:
            self._admitted -= 1

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.generator.encode(text)
        try:
            self.generator.check_fits(ids)
        except UserError as e:
            raise ApiError(400, str(e), param="messages", code="context_length_exceeded") from None
        return ids

    def image_prompt(self, conversation: list[dict[str, Any]], pictures: list[bytes]) -> MediaPrompt:
        """A chat with images (content parts as the processor's template takes them, the pictures' bytes in order)
        through the processor saved with the program, loaded at the first such request."""
        program, folder = self.generator.program, self.generator.pte.parent
        try:
            check_sees_images(program)
        except UserError:
            raise ApiError(400, "an image_url content part: this program takes text only (images go to a "
                           "vision-language program).", param="messages", code="unsupported_content") from None
        try:
            with self._processor_lock:
                if self._processor is None:
                    self._processor = load_processor(folder)
            opened = [open_picture(picture) for picture in pictures]
            made = conversation_prompt(program, self._processor, folder, conversation, opened)
            self.generator.check_fits(made.ids)
        except UserError as e:
            raise ApiError(400, str(e), param="messages") from None
        return made

    def audio_prompt(self, data: bytes, fmt: str, text: str, pictures: Sequence[bytes] = ()) -> MediaPrompt:
        """One user turn of ``text`` about a recording (``fmt`` bytes), and ``pictures`` before it where the program
        also sees (Gemma 4), through the preprocessor and processor saved with it and the model's user turn (as
        ``exporters.generate audio=... image=... chat=true``)."""
        program = self.generator.program
        if AUDIO_METHOD not in program.method_names:
            raise ApiError(400, "an input_audio content part: this program takes no audio (recordings go to an "
                           "audio-language program).", param="messages", code="unsupported_content")
        if pictures:
            try:
                check_sees_images(program)
            except UserError:
                raise ApiError(400, "an image_url content part beside the recording: this program hears and does not "
                               "see (images go to a vision-language program).", param="messages",
                               code="unsupported_content") from None
        with tempfile.TemporaryDirectory(prefix="input_audio") as folder:
            path = Path(folder) / f"recording.{fmt}"
            path.write_bytes(data)
            images = [Path(folder) / f"image_url{i}" for i in range(len(pictures))]
            for image, picture in zip(images, pictures):
                image.write_bytes(picture)
            try:
                return self.generator.with_audio(text, str(path), chat=True, entry=self._audio,
                                                 images=[str(image) for image in images])
            except UserError as e:
                said = str(e).replace(f"audio={path}", "input_audio").replace(str(path), "input_audio")
                for image in images:
                    said = said.replace(f"image={image}", image.name).replace(str(image), image.name)
                raise ApiError(400, said, param="messages") from None

    def constraint(self, schema: dict[str, Any] | None) -> Constraint:
        """The grammar of ``schema`` (None: any JSON object) for one answer; a schema the engine cannot use is a 400.
        The engine's tokenizer is made at the first (about 0.3 s for a 49k vocabulary)."""
        try:
            return self.generator.grammars.json_schema(schema)
        except UserError as e:
            raise ApiError(400, f"response_format: {e}", param="response_format", code="invalid_schema") from None

    def tool_constraint(self, tools: ToolCalls) -> Constraint:
        """The grammar of a tool call: the whole answer, or (``tool_choice=auto``) each call the model opens."""
        grammars = self.generator.grammars
        try:
            return grammars.tagged(tools.schema, *tools.tags) if tools.tags else grammars.json_schema(tools.schema)
        except UserError as e:
            raise ApiError(400, f"tools: {e}", param="tools", code="invalid_schema") from None

    def run(self, job: Job) -> Answer:
        """Generate for ``job`` (in the worker thread: the only one that touches the program)."""
        if job.cancelled.is_set():
            raise Cancelled()
        try:
            self.generator.use_adapter(job.model)
        except UserError as e:
            raise ApiError(400, str(e), param="model") from None
        text = StopText(job.stops)

        def on_text(piece: str) -> None:
            if job.cancelled.is_set():
                raise Cancelled()
            released = text.push(piece)
            if released and job.on_text:
                job.on_text(released)
            if text.stopped:
                raise Stopped()

        recorder = None if job.top_logprobs is None else Recorder(job.top_logprobs,
                                                                   lambda: self.generator.progress.new_ids)
        try:
            result = self.generator.generate("", job.sampling, on_text, prompt_ids=job.ids, media=job.media,
                                             speculative=self.speculative,
                                             on_logits=None if recorder is None else recorder.seen,
                                             constraint=job.constraint)
            finish = "stop" if result.stop_reason == "eos" else "length"
            tail = text.flush()
            if tail and job.on_text:
                job.on_text(tail)
        except Stopped:
            finish = "stop"
        except Cancelled:
            log.info("a client left: its generation stopped after %d token%s", len(self.generator.progress.new_ids),
                     "" if len(self.generator.progress.new_ids) == 1 else "s")
            raise
        done = self.generator.progress
        return Answer(text.released, len(job.ids), len(done.new_ids), done.cached, finish,
                      None if recorder is None else recorder.result())

    def token_text(self, token: int) -> str:
        return self.generator.tokenizer.decode([token])


def random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
