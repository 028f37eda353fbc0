"""llama-server's mixed prompts: token ids with texts between them ([12, 34, "text", 56]), one prompt.

llama-server's tokenize_mixed reads each text in place, with the vocabulary's specials only for a text
that opens the prompt. Here each text is one tokenize query to the model's worker (it holds the
vocabulary), so the worker is handed plain token ids, as for any prompt of ids. /completion and
/v1/embeddings take them."""

from __future__ import annotations

from aiohttp import web

from daemon.http.core.run import run_query


def is_mixed(prompt: object) -> bool:
    return isinstance(prompt, list) and any(isinstance(piece, str) for piece in prompt)


async def mixed_tokens(request: web.Request, model, prompt: list[int | str]) -> list[int]:
    tokens: list[int] = []
    for i, piece in enumerate(prompt):
        if isinstance(piece, int):
            tokens.append(piece)
            continue
        job = model.controller.new_query("mixed-prompt.tokenize", "tokenize", text=piece, add_special=i == 0,
                                         with_pieces=False)
        tokens += (await run_query(request, model, job)).tokens
    return tokens
