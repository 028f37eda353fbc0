"""llama-server's extras, in its request and response shapes: /tokenize,
/detokenize, /apply-template and the native /completion (whose answer is
answer.py's); the embeddings routes are embeddings.py's.

Tokenizing, templates and embeddings need the loaded model, so each is a
query to the worker (protocol.Query): it wakes a sleeping model and waits its
turn like a generation. The native /completion is a generation with other
field names and another answer.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from daemon.http.errors import ApiError
from daemon.http.keys import model_for
from daemon.http.core.job import generation_model, parse_body, structured_grammar
from daemon.http.core.run import run_query
from daemon.http.core.conversation import ImageRefused, base64_image, checked_image
from daemon.http.dialects.llama_server import embeddings
from daemon.http.dialects.llama_server.answer import native_answer, native_whole
from daemon.http.dialects.llama_server.mixed_prompt import is_mixed, mixed_tokens
from daemon.http.dialects.llama_server.schemas import (ApplyTemplateRequest, DetokenizeRequest, MediaPrompt,
                                                       NativeCompletionRequest, TokenizeRequest)


def _piece(data: bytes) -> str | list[int]:
    """As llama-server: the text of a piece, or its bytes when it is not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def tokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, TokenizeRequest)
    model = model_for(request, body.model)
    job = model.controller.new_query("tokenize", "tokenize", text=body.content, add_special=body.add_special,
                                     with_pieces=body.with_pieces)
    answer = await run_query(request, model, job)
    if body.with_pieces:
        return web.json_response({"tokens": [{"id": t, "piece": _piece(b)} for t, b in zip(answer.tokens, answer.pieces)]})
    return web.json_response({"tokens": answer.tokens})


async def detokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, DetokenizeRequest)
    model = model_for(request, body.model)
    answer = await run_query(request, model, model.controller.new_query("detokenize", "detokenize", tokens=body.tokens))
    return web.json_response({"content": answer.text})


async def apply_template(request: web.Request) -> web.Response:
    body = await parse_body(request, ApplyTemplateRequest)
    try:
        messages = [m.to_protocol(_no_images) for m in body.messages]
    except ImageRefused as exc:
        raise ApiError(400, str(exc), exc.code, param="messages") from None
    model = model_for(request, body.model)
    job = model.controller.new_query("apply-template", "apply_template", messages=messages,
                                     tools=[t.to_protocol() for t in body.tools or ()], **body.template_args())
    answer = await run_query(request, model, job)
    return web.json_response({"prompt": answer.text})


def _no_images(part) -> bytes:
    raise ImageRefused("/apply-template renders text only: remove the images")


# -- the native /completion --------------------------------------------------------

def check_slot(id_slot: int, parallel: int) -> None:
    """llama-server's id_slot names one of this model's slots, or is -1 (the engine chooses)."""
    if id_slot >= parallel:
        raise ApiError(400, f"id_slot: this model has slots 0..{parallel - 1} (parallel = {parallel})",
                       "invalid_value", param="id_slot")


def _n_predict(body: NativeCompletionRequest, settings) -> int:
    """The request's n_predict (or its alias max_tokens), else the server's; -1: until the end; 0: the
    prompt is read (into the slot's cache, which is what editor plugins' warm-ups send it for) and
    nothing predicted."""
    if "n_predict" in body.model_fields_set:
        return body.n_predict
    if body.max_tokens is not None:
        return body.max_tokens
    return -1 if settings.n_predict is None else settings.n_predict


MEDIA_MARKER = "<__media__>"  # mtmd's default marker, which the worker's projector reads


def media_fields(prompts: list, settings) -> dict[int, dict]:
    """The job fields (prompt, images) of each object prompt with multimodal_data (llama-server's), by its
    index: every prompt checked here, before the model wakes and before the first is answered. Refused:
    a model with no projector; more images in the request than max_images_per_request; an image that is
    not base64, too large or not an image; markers that do not pair with the images (mtmd puts each image
    at a marker, in order); a prompt that ends with an image (the answer is read on from a text token)."""
    media = {i: prompt for i, prompt in enumerate(prompts) if isinstance(prompt, MediaPrompt)}
    if not media:
        return {}
    where = (lambda i: f"prompt[{i}]: ") if len(prompts) > 1 else (lambda i: "")
    if not settings.mmproj:
        raise ApiError(400, "multimodal_data: this model has no multimodal projector (start it with --mmproj)",
                       "invalid_request", param="prompt")
    count = sum(len(prompt.multimodal_data) for prompt in media.values())
    if count > settings.max_images_per_request:
        raise ApiError(400, f"{count} images in one request; at most {settings.max_images_per_request} are accepted "
                            "(max_images_per_request)", "too_many_images", param="prompt")
    fields = {}
    for index, prompt in media.items():
        text, markers = prompt.prompt_string, prompt.prompt_string.count(MEDIA_MARKER)
        if markers != len(prompt.multimodal_data):
            raise ApiError(400, f"{where(index)}the prompt has {markers} {MEDIA_MARKER} markers and "
                                f"{len(prompt.multimodal_data)} images: each image goes at a marker, in order",
                           "invalid_request", param="prompt")
        if text.endswith(MEDIA_MARKER):
            raise ApiError(400, f"{where(index)}the prompt ends with an image: put text after its last "
                                f"{MEDIA_MARKER} marker; the answer is read on from a text token",
                           "invalid_request", param="prompt")
        try:
            images = [checked_image(_image_data(data, f"multimodal_data[{i}]"), i + 1, settings.max_image_pixels)
                      for i, data in enumerate(prompt.multimodal_data)]
        except ImageRefused as exc:
            raise ApiError(400, f"{where(index)}{exc}", exc.code, param="prompt") from None
        fields[index] = {"prompt": text, "images": images}
    return fields


def _image_data(data: str, what: str) -> bytes:
    """Base64, as llama-server takes it, or a data: URL with base64 content."""
    if data.startswith("data:"):
        if ";base64," not in data:
            raise ImageRefused(f"{what} is a data: URL without base64 content (data:image/png;base64,...)")
        data = data.split(";base64,", 1)[1]
    return base64_image(data, what)


async def completion(request: web.Request) -> web.StreamResponse:
    """llama-server's /completion: `content` and `stop` instead of choices, and timings. Several prompts
    (a list of them) are answered whole, as a list in their order, each with its index."""
    body = await parse_body(request, NativeCompletionRequest)
    grammar = await structured_grammar(request, body)
    model = generation_model(request, body)
    several = len(body.prompts()) > 1
    if several and body.stream:
        raise ApiError(400, "stream: several prompts are answered whole, as a list; stream one prompt per request",
                       "invalid_value", param="stream")
    settings = model.controller.settings
    check_slot(body.id_slot, settings.parallel)
    if body.n > 1:
        raise ApiError(400, "n: /completion answers one completion (its answer has no choices); use /v1/completions",
                       "invalid_value", param="n")
    n_predict = _n_predict(body, settings)  # 0: read the prompt into the cache, predict nothing
    # Token ids come with the logprobs entries: return_tokens alone asks for the chosen token's only.
    logprobs = body.n_probs if body.n_probs else 0 if body.return_tokens else None
    post_sampling = body.post_sampling_probs and body.n_probs > 0
    # -1: until the end of generation or of the slot's context (the worker stops there).
    params = body.sampling(n_predict if n_predict >= 0 else settings.ctx_size, grammar, logprobs, defaults=settings)
    params = msgspec.structs.replace(params, post_sampling_probs=post_sampling)
    media = media_fields(body.prompts(), settings)  # every prompt's images checked before the first is answered
    if not several:
        if is_mixed(body.prompt):  # token ids with texts between them: the texts tokenized in place
            body.prompt = await mixed_tokens(request, model, body.prompt)
        job = model.controller.new_job("completion", params, **media.get(0, {"prompt": body.prompt}),
                                       cache_prompt=body.cache_prompt, slot=body.id_slot, progress=body.wants_progress)
        return await native_answer(request, model, job, body, params, n_predict, post_sampling)
    # One job after another: a request never holds more slots than a single prompt would.
    answers = []
    for index, prompt in enumerate(body.prompts()):
        one = body.model_copy(update={"prompt": await mixed_tokens(request, model, prompt) if is_mixed(prompt)
                                      else prompt})
        job = model.controller.new_job("completion", params, **media.get(index, {"prompt": one.prompt}),
                                       cache_prompt=body.cache_prompt, slot=body.id_slot)
        try:
            answer = await native_whole(request, model, job, one, params, n_predict, post_sampling)
        except ApiError as exc:
            exc.message = f"prompt[{index}]: {exc.message}"  # which of the prompts; the answers before it are dropped
            raise
        answers.append({**answer, "index": index})
    return web.json_response(answers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/apply-template", apply_template)
    app.router.add_post("/completion", completion)
    app.router.add_post("/completions", completion)  # as llama-server routes it: native, not OpenAI's (/v1/completions)
    embeddings.add_routes(app)
