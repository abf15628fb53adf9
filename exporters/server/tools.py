"""Tool calls (OpenAI's ``tools`` and ``tool_choice``): the functions given to the chat template, the call constrained
to them (``exporters.runtime.constraint``), the answer returned as ``tool_calls``.

As vLLM does for a forced call: ``tool_choice`` naming a function constrains the answer to that function's
``parameters`` (the arguments object); ``required`` constrains it to a JSON list of one or more calls, each
``{"name": ..., "arguments": {...}}`` of one of the functions. ``none`` gives the template the tools and constrains
nothing. ``auto`` (OpenAI's default) lets the model write text and calls in its own syntax, read from its chat
template: Hermes' ``<tool_call>`` tags (Qwen2.5 and the templates that copy it), each call constrained from the moment
the model opens the tag; a template that names no syntax this module reads is refused with what works instead.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from exporters.server.errors import ApiError

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: Function


ToolChoice = Union[Literal["none", "auto", "required"], dict[str, Any], None]


#: Hermes-style calls (Qwen2.5, Hermes and the templates that copy them): ``<tool_call>\n{"name": ..., "arguments":
#: ...}\n</tool_call>`` in the text, recognised by the template naming the tag.
HERMES = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ToolCalls:
    """What a request with tools asks of its answer: ``schema`` constrains it (a call's arguments when ``name`` is
    the function ``tool_choice`` named; else a list of ``{"name", "arguments"}`` calls, or, with ``tags``, each call
    the model writes between those tags in its text, for ``tool_choice=auto``)."""

    schema: dict[str, Any]
    name: str | None = None
    tags: tuple[str, str] | None = None

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer (ended, not cut by max_tokens) as OpenAI's ``content`` and ``tool_calls``; a call a stop string
        cut short stays text."""
        try:
            return self._split(text)
        except (ValueError, KeyError, TypeError):
            return text, []

    def _split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.tags is not None:
            found = re.compile(re.escape(self.tags[0]) + r"\n(.*?)\n" + re.escape(self.tags[1]), re.DOTALL)
            made = [json.loads(body) for body in found.findall(text)]
            rest = found.sub("", text).strip()
            return (rest or None) if made else text, _calls([(c["name"], c["arguments"]) for c in made])
        answer = json.loads(text)
        made = [(self.name, answer)] if self.name is not None else [(c["name"], c["arguments"]) for c in answer]
        return None, _calls(made)


def _calls(made: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in made]


def tool_calls(tools: list[Tool] | None, choice: ToolChoice, parallel: bool | None = None,
               tags: tuple[str, str] | None = HERMES) -> ToolCalls | None:
    """The constraint ``tools`` and ``tool_choice`` ask for (None: the answer is text), or a 400 saying why not;
    ``parallel`` false: one call at most (``parallel_tool_calls``); ``tags``: how the model writes a call in its
    text (its chat template's syntax), None when the template names none."""
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice without tools: give the functions in tools.", param="tool_choice")
        return None
    functions = {t.function.name: t.function.parameters or ANY_ARGUMENTS for t in tools}
    if len(functions) != len(tools):
        raise ApiError(400, "tools name a function twice: each function once.", param="tools")
    if choice == "none":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for name, parameters in functions.items()]
    if choice in (None, "auto"):
        if tags is None:
            raise ApiError(400, "tool_choice=auto (the default with tools) lets the model choose between text and a call "
                           "in its own syntax, and this program's chat template names none this server reads (Hermes' "
                           "<tool_call> tags): set tool_choice to \"required\" (one or more calls) or to {\"type\": "
                           "\"function\", \"function\": {\"name\": ...}} (that function), or \"none\".",
                           param="tool_choice", code="unsupported_parameter")
        return ToolCalls({"anyOf": calls}, tags=tags)
    if choice == "required":
        most = {"maxItems": 1} if parallel is False else {}
        return ToolCalls({"type": "array", "items": {"anyOf": calls}, "minItems": 1, **most})
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in functions:
        raise ApiError(400, f"tool_choice={json.dumps(choice)}: \"none\", \"required\", or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}} naming one of the tools ({', '.join(functions)}).",
                       param="tool_choice")
    return ToolCalls(functions[name], name=name)


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (OpenAI's shape, as transformers passes it on)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_message(role: str, content: str, calls: list[dict[str, Any]] | None, call_id: str | None) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's earlier calls with their arguments as objects (OpenAI
    sends them as JSON text), a tool's result with the id of the call it answers."""
    message: dict[str, Any] = {"role": role, "content": content}
    if calls:
        message["tool_calls"] = [{**call, "function": {**call["function"], "arguments": _arguments(call)}}
                                 for call in calls]
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ApiError(400, f"an assistant message's tool call has arguments that are not JSON: {arguments!r}.",
                       param="messages") from None
