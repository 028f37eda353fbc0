"""llama-server's router --models-dir: a directory of GGUF files read as [models.ID] tables.

Its layout is llama-server's (tools/server/README.md, "Using multiple models"):

    models/
      llama-3.2-1b-Q4_K_M.gguf          one file: the model "llama-3.2-1b-Q4_K_M"
      gemma-3-4b-it-Q8_0/               a folder: the model "gemma-3-4b-it-Q8_0"
        gemma-3-4b-it-Q8_0.gguf           its weights
        mmproj-F16.gguf                   its projector (the name starts with "mmproj")
      Kimi-K2-UD-IQ1_S/                 a split model: its first shard is loaded
        Kimi-K2-UD-IQ1_S-00001-of-00006.gguf ...

Read when the settings are (at start, check-config and reload). A table of the config file with the
same id wins over the directory's entry (the file is where an operator sets ctx_size and the rest).
Anything the layout cannot say unambiguously (a folder with two unrelated models, a name that cannot
be a model id) is refused with the file named, never skipped in silence.
"""

from __future__ import annotations

import re
from pathlib import Path

from config.models import MODEL_ID

SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
MAX_ENTRIES = 64  # the fleet's own bound on [models.ID] tables


def _ggufs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() == ".gguf" and not p.name.startswith(".")
                  and p.is_file())


def _is_projector(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


def _model_id(name: str, where: Path) -> str:
    if not MODEL_ID.fullmatch(name) or not name.strip("."):
        raise ValueError(f"models_dir: {where}: {name!r} cannot be a model id (1-128 letters, digits, '.', '_', "
                         "':' or '-'); rename it")
    return name


def _folder_model(folder: Path) -> dict[str, str]:
    files = _ggufs(folder)
    projectors = [p for p in files if _is_projector(p)]
    weights = [p for p in files if not _is_projector(p)]
    shards = [p for p in weights if SHARD.search(p.name)]
    if shards and len(shards) == len(weights):
        weights = [p for p in shards if int(SHARD.search(p.name).group(1)) == 1]
    if len(weights) != 1:
        found = ", ".join(p.name for p in weights) or "no .gguf but projectors"
        raise ValueError(f"models_dir: {folder}: a folder holds one model (its weights, or the shards of one "
                         f"split model, and an mmproj*.gguf); found {found}")
    if len(projectors) > 1:
        raise ValueError(f"models_dir: {folder}: more than one projector: {', '.join(p.name for p in projectors)}")
    table = {"path": str(weights[0])}
    if projectors:
        table["mmproj"] = str(projectors[0])
    return table


def _readable_name(table: dict[str, str]) -> None:
    """A path the worker protocol can carry (UTF-8): a name in another encoding is refused here, at start."""
    for path in table.values():
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"models_dir: {path.encode('utf-8', 'replace').decode()}: the file name is not "
                             "UTF-8; rename it") from None


def models_in_dir(directory: Path) -> dict[str, dict[str, str]]:
    """{model id: {"path": ..., "mmproj": ...}} for each model in `directory`, in name order."""
    if not directory.is_dir():
        raise ValueError(f"models_dir: {directory} is not a directory")
    found: dict[str, dict[str, str]] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and _ggufs(entry):
            model_id, table = _model_id(entry.name, entry), _folder_model(entry)
        elif entry.is_file() and entry.suffix.lower() == ".gguf" and not _is_projector(entry):
            model_id, table = _model_id(entry.name[:-len(entry.suffix)], entry), {"path": str(entry)}
        else:
            continue
        if model_id in found:
            raise ValueError(f"models_dir: {directory}: both a file and a folder are named {model_id!r}; keep one")
        _readable_name(table)
        found[model_id] = table
        if len(found) > MAX_ENTRIES:
            raise ValueError(f"models_dir: {directory} holds more than {MAX_ENTRIES} models (the fleet's bound)")
    if not found:
        raise ValueError(f"models_dir: {directory} holds no .gguf model (a file, or a folder of one model)")
    return found


def with_models_dir(data):
    """The settings' raw data with models_dir's models added as tables (a table of the same id wins)."""
    if not isinstance(data, dict) or not data.get("models_dir"):
        return data
    directory = data["models_dir"]
    if not isinstance(directory, (str, Path)):
        raise ValueError(f"models_dir: expects a directory's path, got {type(directory).__name__}")
    try:
        found = models_in_dir(Path(directory).expanduser())
    except OSError as exc:  # a folder it may not read (lost+found), a name the system refuses: one line, no traceback
        raise ValueError(f"models_dir: cannot read {exc.filename or directory}: {exc.strerror or exc}") from None
    tables = dict(data.get("models") or {})
    for model_id, table in found.items():
        tables.setdefault(model_id, table)
    return {**data, "models": tables}
