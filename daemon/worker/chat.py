"""Chat messages to a prompt, with the model's Jinja chat template.

The template comes from the GGUF (tokenizer.chat_template) or from
--chat-template-file. A model without one gets FALLBACK_TEMPLATE, a plain
"role: content" transcript ending in "assistant:" (documented in the README).
Templates run in Jinja's immutable sandbox, as llama-server and transformers do.

Tools: messages follow transformers' convention (an assistant turn's
tool_calls with arguments as a mapping, "tool" turns with tool_call_id), so a
template that knows tools (it names `tools`, as Qwen's, Llama 3.1's and
Mistral's do) gets them and the messages as they are. Any other template (the
built-in Gemma one, the fallback, most small models') gets the Hermes
convention spelled out in plain turns: the tools described in the system turn,
calls written as <tool_call> blocks, results as <tool_response> blocks in a
user turn. That is the markup daemon.tools.parse reads back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import date
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.protocol import ChatMessage, Tool
from daemon.tools.parse import HERMES_CLOSE, HERMES_OPEN

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
IMAGE_MARKER = "<__media__>"  # mtmd's default marker, replaced by image embeddings


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain JSON. Jinja's own escapes <, >, & and ' for
    HTML, which would garble a tool's schema or a call's arguments in a prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatRenderer:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.source = template or FALLBACK_TEMPLATE
        self.is_fallback = template is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: date.today().strftime(fmt))
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def supports_tools(self) -> bool:
        """The template handles tools itself (it names them); otherwise render
        describes them in the system turn."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], tools: Sequence[Tool | dict[str, Any]] | None = None) -> str:
        """The prompt for `messages` (transformers' convention, see
        template_messages), with `tools` offered to the model."""
        schemas = tool_schemas(tools)
        if self.supports_tools:
            return self._render(messages, tools=schemas)
        return self._render(hermes_messages(messages, schemas))

    def _render(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        try:
            return self._template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
                **extra,
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as exc:
            # A template that trips on a message's shape (a filter given a string
            # where it wanted a mapping) is the request's problem, not the worker's.
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


# -- messages and tools in transformers' convention ------------------------------


def template_messages(messages: list[ChatMessage], contents: list[str]) -> list[dict[str, Any]]:
    """Protocol messages as template messages, each with its already flattened
    content (the engine flattens it, since it handles the images). Keys that
    a message does not use are left out, so a plain chat is role and content only."""
    if len(messages) != len(contents):
        raise ValueError(f"{len(messages)} messages but {len(contents)} contents")
    rendered = []
    for message, content in zip(messages, contents):
        item: dict[str, Any] = {"role": message.role, "content": content}
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": _arguments_object(call.arguments)}}
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        rendered.append(item)
    return rendered


def tool_schemas(tools: Sequence[Tool | dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as templates take them (OpenAI's tools[] items); None for none.
    A dict is taken as already in that shape."""
    if not tools:
        return None
    return [
        tool if isinstance(tool, dict)
        else {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}
        for tool in tools
    ]


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as the mapping templates expect; the text itself
    when it is not a JSON object (the template shows what the client sent)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


# -- the Hermes convention, for templates that know nothing of tools ------------


def hermes_messages(messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with tools, calls and results written as plain turns: the
    tools described at the start of the first system turn (one is added if
    there is none), an assistant's calls as <tool_call> blocks after its
    content, and each run of tool results as one user turn of <tool_response>
    blocks. Messages without any of these are passed through as they are, so
    a plain chat renders exactly as it did before tools."""
    rewritten: list[dict[str, Any]] = []
    responses: list[str] = []  # the run of tool results not yet written as a user turn
    for message in messages:
        if message.get("role") == "tool":
            responses.append(f"<tool_response>\n{message.get('content', '')}\n</tool_response>")
            continue
        if responses:
            rewritten.append({"role": "user", "content": "\n".join(responses)})
            responses = []
        if message.get("tool_calls"):
            message = {"role": message["role"], "content": _with_call_blocks(message.get("content") or "", message["tool_calls"])}
        rewritten.append(message)
    if responses:
        rewritten.append({"role": "user", "content": "\n".join(responses)})
    if schemas:
        rewritten = _with_tools_described(rewritten, schemas)
    return rewritten


def _with_call_blocks(content: str, tool_calls: list[dict[str, Any]]) -> str:
    blocks = [content] if content else []
    for call in tool_calls:
        function = call.get("function", call)  # OpenAI's nesting, or the bare name and arguments
        payload = {"name": function.get("name"), "arguments": function.get("arguments", {})}
        blocks.append(f"{HERMES_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{HERMES_CLOSE}")
    return "\n".join(blocks)


def _with_tools_described(messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    description = _tools_description(schemas)
    for index, message in enumerate(messages):
        if message.get("role") == "system":
            content = message.get("content") or ""
            joined = f"{description}\n\n{content}" if content else description
            return [*messages[:index], {**message, "content": joined}, *messages[index + 1 :]]
    return [{"role": "system", "content": description}, *messages]


def _tools_description(schemas: list[dict[str, Any]]) -> str:
    lines = ["You can call these tools (functions). Each is described by its name, what it does and the JSON schema of its arguments:"]
    for schema in schemas:
        function = schema.get("function", schema)
        lines.append(json.dumps(
            {"name": function.get("name"), "description": function.get("description", ""), "parameters": function.get("parameters", {})},
            ensure_ascii=False,
        ))
    lines += [
        "",
        "To call a tool, answer with one block per call:",
        HERMES_OPEN,
        '{"name": <name>, "arguments": <args-object>}',
        HERMES_CLOSE,
        "The results come back as <tool_response> blocks.",
    ]
    return "\n".join(lines)


# Built-in templates for model families whose GGUF may lack one (the bundled
# Gemma 3 270M file has no tokenizer.chat_template). Picked by
# general.architecture prefix.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
BUILTIN_TEMPLATES = {"gemma": GEMMA_TEMPLATE}
# Markers that end an assistant turn (or begin the next one). Some GGUFs do not flag them as
# end-of-generation tokens, so chat requests stop on them explicitly.
END_OF_TURN_MARKERS = ("<end_of_turn>", "<start_of_turn>", "<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|end|>")


def template_for(configured: str | None, from_gguf: str | None, architecture: str | None) -> str | None:
    """Configured template > the GGUF's > a built-in one for the architecture >
    None (the fallback transcript)."""
    if configured:
        return configured
    if from_gguf:
        return from_gguf
    for prefix, template in BUILTIN_TEMPLATES.items():
        if (architecture or "").startswith(prefix):
            return template
    return None
