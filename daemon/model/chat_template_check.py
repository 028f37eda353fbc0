"""A model with no chat template, said once at start (issue 30: "the first chat is
gibberish and nothing says why").

A GGUF without `tokenizer.chat_template` is usually a base model (the bundled
Gemma 3 270M is one): its chat requests are rendered through a generic
transcript and its answers rarely follow the conversation. The daemon still
serves it (completions are what a base model is for), but the log says why a
chat may read as nonsense and what to serve instead. A configured template
(`chat_template`, `chat_template_file`) or an embeddings model needs no warning.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from daemon.fleet.plans import ModelPlan
from daemon.model.gguf_header import GgufError, read_header

# An instruction-tuned model that the README's first chat serves by name.
CHAT_MODEL_EXAMPLE = "dormouse serve -hf ggml-org/gemma-3-1b-it-GGUF"


def has_chat_template(path: str) -> bool | None:
    """True/False from the GGUF's metadata; None when the header cannot be read (check-config says why)."""
    try:
        template = read_header(path).metadata.get("tokenizer.chat_template")
    except (GgufError, OSError):
        return None
    return isinstance(template, str) and template.strip() != ""


def untemplated(plans: Iterable[ModelPlan]) -> list[ModelPlan]:
    """The plans whose chats would fall back to the generic transcript."""
    return [plan for plan in plans
            if not plan.settings.embeddings and not plan.settings.chat_template
            and not plan.settings.chat_template_file and plan.files_present
            and has_chat_template(plan.model_path) is False]


async def warn_untemplated(plans: list[ModelPlan], log) -> None:
    for plan in await asyncio.to_thread(untemplated, plans):  # headers are read off the event loop
        log.warning("model.no_chat_template", model=plan.id, path=plan.model_path,
                    meaning="a base model: /v1/chat/completions uses a generic transcript and answers may not "
                            "follow the conversation; completions are unaffected",
                    fix=f"serve an instruction-tuned model (e.g. {CHAT_MODEL_EXAMPLE}) or set chat_template")
