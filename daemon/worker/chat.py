"""Chat messages to a prompt, with the model's Jinja chat template.

The template comes from the GGUF (tokenizer.chat_template) or from
--chat-template-file. A model without one gets FALLBACK_TEMPLATE, a plain
"role: content" transcript ending in "assistant:" (documented in the README).
Templates run in Jinja's immutable sandbox, as llama-server and transformers do.
"""

from __future__ import annotations

from datetime import date
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
IMAGE_MARKER = "<__media__>"  # mtmd's default marker, replaced by image embeddings


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class ChatRenderer:
    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.source = template or FALLBACK_TEMPLATE
        self.is_fallback = template is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: date.today().strftime(fmt))
        self._template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self._template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


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
