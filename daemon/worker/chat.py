"""Chat messages to a prompt, with the model's Jinja chat template.

The template comes from --chat-template-file, --chat-template (Jinja text, or
one of llama.cpp's built-in template names, rendered by llama.cpp's own
llama_chat_apply_template) or the GGUF (tokenizer.chat_template). A model
without one gets FALLBACK_TEMPLATE, a plain "role: content" transcript ending
in "assistant:" (documented in the README).

Templates run in Jinja's immutable sandbox with what transformers and
llama-server give them: the loop controls `{% break %}` / `{% continue %}`,
transformers' `{% generation %}` block, raise_exception, strftime_now, a tojson
that writes plain JSON, and the variables messages, tools, bos_token,
eos_token, add_generation_prompt, enable_thinking, date_string, datetime, and
the request's chat_template_kwargs. A template that does not compile is
refused when the model loads (ChatTemplateInvalid, "chat template: ..."): no
request could use it, so the daemon does not load it again until its
configuration changes.

As llama-server: a template that refuses the system role (Gemma 2 raises, or
drops it) gets the first system message folded into the next message; an
assistant message may be continued (assistant prefill) rather than closed;
and an assistant message's reasoning_content reaches the templates that read it.

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

import ctypes
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.protocol import ChatMessage, Tool
from daemon.tools.parse import HERMES_CLOSE, HERMES_OPEN
from daemon.tools.reasoning import ends_inside_reasoning, markers_in

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
IMAGE_MARKER = "<__media__>"  # mtmd's default marker, replaced by image embeddings
# Variables the server sets: chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
_SYSTEM_PROBE = "<dormouse: is the system message shown?>"


class ChatTemplateError(ValueError):
    """The template refused this request's messages (the request's problem)."""


class ChatTemplateInvalid(ValueError):
    """The template cannot be used at all; the message starts with "chat template:"
    (the worker reports the load failure with code "chat_template")."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # local time, as transformers and llama.cpp


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain JSON. Jinja's own escapes <, >, & and ' for
    HTML, which would garble a tool's schema or a call's arguments in a prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (its
    AssistantTracker): marks the assistant's part for training masks; for a
    prompt it renders its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    reasoning_open: bool = False  # the prompt ends inside a thinking block: the answer starts with thinking


class ChatRenderer:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.source = template or FALLBACK_TEMPLATE
        self.is_fallback = template is None
        self.builtin = template if template is not None and template in llama_cpp_template_names() else None
        self._template = None
        if self.builtin is None:
            try:
                self._template = _environment().from_string(self.source)
            except TemplateSyntaxError as exc:
                raise ChatTemplateInvalid(f"chat template: {exc.message} (line {exc.lineno})") from None
            except TemplateError as exc:
                raise ChatTemplateInvalid(f"chat template: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.reasoning_markers = markers_in(self.source)  # (opening, closing) the template writes, if any
        self.supports_system_role = self._shows_system_role()

    @property
    def supports_tools(self) -> bool:
        """The template handles tools itself (it names them); otherwise render
        describes them in the system turn."""
        return self.builtin is None and "tools" in self.source

    def render(self, messages: list[dict[str, Any]], tools: Sequence[Tool | dict[str, Any]] | None = None,
               **options: Any) -> str:
        """The prompt text for `messages` (see prompt)."""
        return self.prompt(messages, tools, **options).text

    def prompt(self, messages: list[dict[str, Any]], tools: Sequence[Tool | dict[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, continue_final: bool = False,
               kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        """The prompt for `messages` (transformers' convention, see
        template_messages), with `tools` offered to the model. continue_final:
        the last message is the assistant's, continued rather than closed
        (llama-server's assistant prefill). kwargs: the request's
        chat_template_kwargs, as template variables."""
        schemas = tool_schemas(tools)
        final = None
        if continue_final:
            if not messages or messages[-1].get("role") != "assistant":
                raise ChatTemplateError("continue_final_message: the last message must be the assistant's")
            if messages[-1].get("tool_calls"):
                raise ChatTemplateError("continue_final_message: an assistant message with tool calls cannot be continued")
            messages, final = messages[:-1], messages[-1]
        if not self.supports_tools:
            messages = hermes_messages(messages, schemas)
        if not self.supports_system_role:
            messages = fold_system_message(messages)
        extra = {"tools": schemas} if self.supports_tools else {}
        text = self._render(messages, add_generation_prompt or final is not None, kwargs, **extra)
        if final is None:
            return ChatPrompt(text, add_generation_prompt and ends_inside_reasoning(text) is not None)
        return self._continued(text, final)

    def _continued(self, text: str, final: dict[str, Any]) -> ChatPrompt:
        """The prompt that ends with `final`'s text, as the answer's start. As
        llama-server: a template that thinks gets the thinking block written
        out (its generation prompt's own opening cut), then the content; with
        thinking and no content, the answer continues the thinking."""
        content = final.get("content") or ""
        reasoning = final.get("reasoning_content") or ""
        if self.reasoning_markers is None:
            return ChatPrompt(text + content)  # nowhere to put the thinking: it is left out
        opening, closing = self.reasoning_markers
        at = text.rfind(opening)
        if at >= 0 and not text[at:].replace(opening, "", 1).replace(closing, "", 1).strip():
            text = text[:at]  # the generation prompt opened (or opened and closed) a block: ours replaces it
        if reasoning and not content:
            return ChatPrompt(text + opening + reasoning, reasoning_open=True)
        return ChatPrompt(text + opening + reasoning + closing + content)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: dict[str, Any] | None = None, **extra: Any) -> str:
        if self.builtin is not None:
            return apply_llama_cpp_template(self.builtin, messages, add_generation_prompt)
        now = datetime.now()
        # functions: the tools as indented JSON ("" without), which llama-server gives FireFunction v2's template.
        functions = json.dumps(extra["tools"], indent=2) if extra.get("tools") else ""
        context = {"enable_thinking": True, "date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"),
                   "functions": functions,
                   **{k: v for k, v in (kwargs or {}).items() if k not in RESERVED_VARIABLES},
                   "messages": messages, "bos_token": self.bos_token, "eos_token": self.eos_token,
                   "add_generation_prompt": add_generation_prompt, **extra}
        try:
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RecursionError) as exc:
            # A template that trips on a message's shape (a filter given a string
            # where it wanted a mapping) is the request's problem, not the worker's.
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def _shows_system_role(self) -> bool:
        """Whether a system message reaches the prompt (llama.cpp's
        supports_system_role): Gemma 2's template raises on one, others drop it."""
        if self.builtin is not None:
            return True  # llama.cpp's built-in templates place it themselves
        probe = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "Hi"}]
        try:
            return _SYSTEM_PROBE in self._render(probe, True)
        except ChatTemplateError:
            try:
                self._render(probe[1:], True)
            except ChatTemplateError:
                return True  # it refuses a plain user turn too: nothing to learn here
            return False


def fold_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-server's way with a template that refuses the system role: the
    first system message is put before the next message's content (a newline
    between); alone, it is dropped."""
    if not messages or messages[0].get("role") != "system":
        return messages
    if len(messages) == 1:
        return []
    system, following = messages[0], messages[1]
    joined = f"{system.get('content') or ''}\n{following.get('content') or ''}"
    return [{**following, "content": joined}, *messages[2:]]


# -- llama.cpp's built-in templates ----------------------------------------------


@cache
def llama_cpp_template_names() -> frozenset[str]:
    """The names llama.cpp's llama_chat_apply_template knows (chatml, llama3, ...)."""
    from daemon.worker.llama_lib import llama

    n = llama.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama.llama_chat_builtin_templates(names, n)
    return frozenset(name.decode() for name in names)


def apply_llama_cpp_template(name: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """llama.cpp's own rendering of a built-in template: roles and text only
    (tools reach it in the Hermes convention, as plain turns)."""
    from daemon.worker.llama_lib import llama

    chat = (llama.llama_chat_message * max(len(messages), 1))()
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        chat[i].role = str(message.get("role", "user")).encode()
        chat[i].content = (content if isinstance(content, str) else str(content)).encode()
    need = llama.llama_chat_apply_template(name.encode(), chat, len(messages), add_generation_prompt, None, 0)
    if need < 0:
        raise ChatTemplateError(f"llama.cpp's {name!r} template cannot render these messages")
    buf = ctypes.create_string_buffer(need + 1)
    llama.llama_chat_apply_template(name.encode(), chat, len(messages), add_generation_prompt, buf, len(buf))
    return buf.raw[:need].decode("utf-8", errors="replace")


# -- messages and tools in transformers' convention ------------------------------


def template_messages(messages: list[ChatMessage], contents: list[str]) -> list[dict[str, Any]]:
    """Protocol messages as template messages, each with its already flattened
    content (the engine flattens it, since it handles the images). Keys that
    a message does not use are left out, so a plain chat is role and content
    only; an assistant's reasoning_content is there for templates that read it."""
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
        if message.reasoning_content is not None:
            item["reasoning_content"] = message.reasoning_content
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
