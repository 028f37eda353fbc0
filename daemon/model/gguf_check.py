"""Before a model is served: its GGUF files whole, not cut short.

files.py checks the magic alone, so a download cut short passed `check-config`
and failed later inside the worker, its cause only in an info line. The header
says where every tensor lies: read_header (gguf_header.py) refuses a header or
a tensor that runs past the end of the file, which is what a truncated file is.
"""

from __future__ import annotations

from pathlib import Path

from daemon.model.files import ModelFileError
from daemon.model.gguf_header import GgufError, read_header

# Header problems that say nothing of the file being whole: a newer llama.cpp may know a tensor
# type this reader does not. The worker's own load judges those; they must not stop a start.
_NOT_OURS_TO_JUDGE = ("unknown ggml type", "is not supported")


def check_complete(path: str | Path, what: str = "model") -> None:
    """Raise ModelFileError, one line, when the file's header or tensor data runs past its end."""
    try:
        read_header(path)  # it places every tensor, and refuses one that ends past the file's end
    except GgufError as exc:
        problem = str(exc)
        if any(phrase in problem for phrase in _NOT_OURS_TO_JUDGE):
            return
        raise ModelFileError(f"{what} file {problem} (cut short or damaged? fetch it again)") from None


def check_plan_files(model_path: str, settings) -> None:
    """The model, its draft and its projector: each whole."""
    check_complete(model_path, "model")
    if settings.model_draft:
        check_complete(settings.model_draft, "draft model")
    if settings.mmproj:
        check_complete(settings.mmproj, "projector")
