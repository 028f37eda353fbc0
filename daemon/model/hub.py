"""A model by name: `owner/repo[:QUANT]` on Hugging Face to local GGUF files.

The downloads go through huggingface_hub: its cache layout, kept under
state_dir/models unless HF_HUB_CACHE or HF_HOME names a cache (hub_cache_dir),
downloads with size checks (a dropped link is resumed with a Range request within
the pull; a killed pull starts the file over, in a temporary file of its own), HF_TOKEN for private and gated repos,
HF_ENDPOINT for a mirror, HF_HUB_OFFLINE for the cache alone. Which file a
repository's listing yields is decided as llama-server's `-hf` decides it
(vendor/llama.cpp common/download.cpp: find_best_model, find_best_sibling),
so a name means the same file here and there:

- a quant tag picks the first model GGUF whose name holds the tag followed by
  '.' or '-' (case-insensitive): `:q4_k_m` finds `...-Q4_K_M.gguf`;
- no tag: Q4_K_M, else Q8_0, else the first model GGUF;
- a model split in parts (`-00001-of-00003.gguf`) brings every part;
- a projector (a GGUF named `mmproj`) in the model's directory or above comes
  along, the one whose quantization is nearest the model's.

Every name is checked before any request: a repository id is owner/name
(the hub's characters, at most 96), a file a relative path inside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

MAX_REPO_ID = 96  # the hub's own limit (huggingface_hub.utils.validate_repo_id)
MAX_SPEC = 256  # anything longer is refused before it is even parsed
MAX_FILE = 1024
REPO_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")
QUANT_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
FILE_PART = re.compile(r"^[A-Za-z0-9_+.()\[\] -]{1,255}$")
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
# Sidecar files a repository ships beside its models (llama.cpp's gguf_filename_is_model).
NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
FILE_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
LISTED = 20  # names an error lists before "and N more"


class HubError(ValueError):
    """Why a model could not be had by name, in one line."""


@dataclass(frozen=True)
class HubName:
    repo_id: str  # owner/name
    tag: str | None  # the quant tag after ':'

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.tag}" if self.tag else self.repo_id


@dataclass(frozen=True)
class PulledModel:
    name: HubName
    model: Path  # the first (or only) part, in huggingface_hub's snapshot folder
    parts: tuple[Path, ...]  # every part of a split model, the first included
    mmproj: Path | None
    from_cache_only: bool  # the hub was not asked (offline, or unreachable)


def parse_hf_repo(spec: Any) -> HubName:
    """`owner/name[:QUANT]` (llama-server's -hf; Ollama's `hf.co/` prefix is accepted). Raises HubError."""
    if not isinstance(spec, str):
        raise HubError(f"a repository is given as text owner/name[:QUANT], not {type(spec).__name__}")
    text = spec.strip()
    if len(text) > MAX_SPEC:
        raise HubError(f"repository name is {len(text)} characters long; owner/name[:QUANT] is at most "
                       f"{MAX_REPO_ID} characters before the tag")
    shown = repr(text[:100])
    for prefix in ("hf.co/", "huggingface.co/"):
        text = text.removeprefix(prefix)
    repo_id, colon, tag = text.partition(":")
    parts = repo_id.split("/")
    if len(parts) != 2:
        raise HubError(f"{shown} is not a repository: expected owner/name[:QUANT], e.g. "
                       "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M")
    for part in parts:
        if not REPO_PART.fullmatch(part) or ".." in part or "--" in part or part.endswith(".git"):
            raise HubError(f"{shown} is not a repository: owner and name are letters, digits, '-', '_' and '.' "
                           "(no '..' or '--', starting with a letter or digit)")
    if len(repo_id) > MAX_REPO_ID:
        raise HubError(f"repository id is {len(repo_id)} characters long; the hub allows at most {MAX_REPO_ID}")
    if colon and not QUANT_TAG.fullmatch(tag):
        raise HubError(f"{shown}: the quant tag after ':' must be 1-64 letters, digits, '_', '-' or '.' "
                       "(e.g. Q4_K_M)")
    return HubName(repo_id, tag if colon else None)


def check_repo_file(name: Any) -> str:
    """A file inside a repository (llama-server's --hf-file): a relative path of plain parts. Raises HubError."""
    if not isinstance(name, str) or not name or len(name) > MAX_FILE:
        raise HubError(f"hf_file must be a file name inside the repository, 1-{MAX_FILE} characters")
    if not _plain_path(name):
        raise HubError(f"hf_file {name[:100]!r} is not a relative path inside the repository (plain names "
                       "separated by '/', no '..')")
    if not name.endswith(".gguf"):
        raise HubError(f"hf_file {name[:100]!r} is not a .gguf file")
    return name


# -- which file: llama-server's rules --

def _split_info(path: str) -> tuple[str, int, int]:
    """(prefix without '.gguf' and the part suffix, part index, part count)."""
    prefix = path.removesuffix(".gguf")
    match = SPLIT.match(prefix)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else (prefix, 1, 1)


def quant_tag(path: str) -> str:
    """'Q4_K_M' for '.../gemma-3-1b-it-Q4_K_M.gguf'; '' when the name carries none."""
    match = FILE_TAG.search(_split_info(path)[0])
    return match.group(1).upper() if match else ""


def _quant_bits(path: str) -> int:
    digits = re.search(r"[0-9]+", quant_tag(path))
    return int(digits.group()) if digits else 0


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(word in name for word in NOT_A_MODEL)


def pick_model_file(files: list[str], tag: str | None) -> str | None:
    """The repository's model GGUF for a quant tag (none: Q4_K_M, Q8_0, then the first); a split model's first part."""
    candidates = [f for f in files if is_model_file(f) and _split_info(f)[1] == 1]
    for wanted in ([tag] if tag else DEFAULT_TAGS):
        pattern = re.compile(re.escape(wanted) + r"[.-]", re.IGNORECASE)
        for path in candidates:
            if pattern.search(path):
                return path
    return candidates[0] if candidates and not tag else None


def split_parts(files: list[str], first: str) -> list[str]:
    """Every part of the model `first` begins (itself alone when it is not split)."""
    prefix, _, count = _split_info(first)
    if count <= 1:
        return [first]
    return sorted(f for f in files if f.endswith(".gguf") and _split_info(f)[0] == prefix
                  and _split_info(f)[2] == count)


def pick_mmproj(files: list[str], model: str) -> str | None:
    """The projector for `model`: in its directory or one above (the deepest wins), then the nearest quantization."""
    model_dirs = model.split("/")[:-1]
    bits = _quant_bits(model)
    best, best_key = None, None
    for path in files:
        if not path.endswith(".gguf") or "mmproj" not in path:
            continue
        dirs = path.split("/")[:-1]
        if dirs != model_dirs[:len(dirs)]:
            continue
        key = (len(dirs), -abs(_quant_bits(path) - bits))
        if best_key is None or key > best_key:  # the first of equals stays, as in llama.cpp
            best, best_key = path, key
    return best


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def choose_files(name: HubName, files: list[str], hf_file: str | None) -> tuple[list[str], str | None]:
    """(the model's parts, the projector or None) from a repository's file list.
    Raises HubError naming what is there."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    models = [f for f in ggufs if is_model_file(f)]
    if hf_file is not None:
        if hf_file not in files:
            raise HubError(f"{name.repo_id} has no file {hf_file!r}; its GGUF files: {_listed(ggufs) or 'none'}")
        model = hf_file
    else:
        model = pick_model_file(files, name.tag)
        if model is None and not models:
            raise HubError(f"{name.repo_id} holds no GGUF model file (it has {len(files)} files"
                           + (f": {_listed(files)}" if files else "") + "); pick a repository of GGUF files, "
                           "often named ...-GGUF")
        if model is None:
            tags = list(dict.fromkeys(quant_tag(f) or f for f in models if _split_info(f)[1] == 1))
            example = next((f" (e.g. {name.repo_id}:{t})" for t in tags if not t.endswith(".gguf")), "")
            raise HubError(f"{name.repo_id} has no GGUF file for the quant tag {name.tag!r}; available: "
                           f"{_listed(tags)}{example}")
    return split_parts(files, model), pick_mmproj(files, model)


# -- the hub and the cache, through huggingface_hub --

def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _cached_files(cache: Path, repo_id: str, revision: str) -> list[str] | None:
    """The files of `repo_id` at `revision` that huggingface_hub's cache holds (None: none at all).
    The cache's layout is the library's documented one: refs/<revision> names a snapshot folder."""
    from huggingface_hub.file_download import repo_folder_name

    folder = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        try:
            commit = (folder / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _list_repo(name: HubName, revision: str, endpoint: str, token: str | None) -> tuple[list[str], str | None]:
    """The repository's file names and its commit, from the hub. Raises HubError, or ConnectionError when the
    hub cannot be reached."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(name.repo_id, revision=revision)
    except (httpx2.TransportError, OfflineModeIsEnabled) as exc:
        raise ConnectionError(_one_line(exc)) from None
    except GatedRepoError:
        raise HubError(f"{name.repo_id} is gated: accept its terms on the hub's page, then set HF_TOKEN to a token "
                       "of that account") from None
    except RepositoryNotFoundError:
        raise HubError(f"repository {name.repo_id} was not found at {endpoint} (a private or gated one needs HF_TOKEN "
                       "set to a token that may read it)") from None
    except RevisionNotFoundError:
        raise HubError(f"{name.repo_id} has no revision {revision!r}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        if status in (401, 403):
            raise HubError(f"{endpoint} refused {name.repo_id} ({status}): set HF_TOKEN to a token that may read "
                           "it") from None
        raise HubError(f"{endpoint} answered {status} for {name.repo_id}: {_one_line(exc)[:200]}") from None
    # A name that could leave the snapshot folder (a hostile or broken listing) is never a candidate.
    files = [s.rfilename for s in info.siblings or [] if isinstance(s.rfilename, str) and _plain_path(s.rfilename)]
    commit = info.sha if isinstance(info.sha, str) and re.fullmatch(r"[0-9a-f]{40}", info.sha) else None
    return files, commit


def _plain_path(name: str) -> bool:
    return 0 < len(name) <= MAX_FILE and all(part not in (".", "..") and FILE_PART.fullmatch(part)
                                             for part in name.split("/"))


def hub_cache_dir(state_directory: str | Path) -> Path:
    """Where models by name are kept: huggingface_hub's cache layout (models--owner--name/blobs, snapshots)
    under `state_dir/models`, so `pull` and `serve` agree and a systemd unit (DynamicUser, ProtectHome) needs
    nothing more than its StateDirectory. A cache the user chose explicitly wins: HF_HUB_CACHE, else
    HF_HOME/hub (one cache shared with llama.cpp, transformers and the `hf` CLI). huggingface_hub's default,
    ~/.cache/huggingface, is not used unless named: it may be read-only or another user's home."""
    import os

    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expanduser(os.environ[variable]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    return Path(state_directory) / "models"


@dataclass(frozen=True)
class _Listing:
    name: HubName
    parts: list[str]
    mmproj: str | None
    commit: str | None  # the hub's commit, when the hub was asked and said
    from_cache: bool
    why_cache: str  # why the hub was not asked (or could not be)
    endpoint: str
    cache: Path


def _settle(spec: str, hf_file: str | None, revision: str, endpoint: str | None, cache_dir: str | Path | None,
            token: str | None, offline: bool | None, with_mmproj: bool) -> _Listing:
    """Which files `spec` means: from the hub's listing, or the cache's when the hub is not to be (or cannot
    be) asked. Nothing is downloaded. Raises HubError."""
    name = parse_hf_repo(spec)
    if hf_file is not None:
        check_repo_file(hf_file)
    from huggingface_hub import constants

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    offline = constants.is_offline_mode() if offline is None else offline
    files, commit, why_cache = None, None, "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            files, commit = _list_repo(name, revision, endpoint, token)
        except ConnectionError as exc:
            why_cache = f"cannot reach the hub at {endpoint} ({exc})"
    from_cache = files is None
    if from_cache:
        files = _cached_files(cache, name.repo_id, revision)
        if files is None:
            raise HubError(f"{why_cache}, and {name.repo_id} is not in the cache {cache}"
                           + (": pull it once online" if offline else ""))
    try:
        parts, mmproj = choose_files(name, files, hf_file)
    except HubError as exc:
        raise HubError(f"{exc} (listed from the cache {cache}: {why_cache})" if from_cache else str(exc)) from None
    return _Listing(name, parts, mmproj if with_mmproj else None, commit, from_cache, why_cache, endpoint, cache)


def pull(spec: str, hf_file: str | None = None, *, revision: str = "main", endpoint: str | None = None,
         cache_dir: str | Path | None = None, token: str | None = None, offline: bool | None = None,
         progress: type | None = None, with_mmproj: bool = True) -> PulledModel:
    """Download (or find in the cache) the model `spec` names, and its projector. Raises HubError.

    endpoint, cache_dir, offline: huggingface_hub's (HF_ENDPOINT, HF_HUB_CACHE or HF_HOME, HF_HUB_OFFLINE)
    when None (the daemon passes hub_cache_dir(state_dir)); token None: HF_TOKEN or the saved login.
    progress: a tqdm class (None: the library's bars, shown on a terminal). An unreachable hub falls back to
    the cache, as llama-server does.
    """
    found = _settle(spec, hf_file, revision, endpoint, cache_dir, token, offline, with_mmproj)
    wanted = found.parts + ([found.mmproj] if found.mmproj else [])
    local = [_download(found.name, f, revision, found.endpoint, found.cache, token, found.from_cache, progress)
             for f in wanted]
    return PulledModel(found.name, local[0], tuple(local[:len(found.parts)]),
                       local[-1] if found.mmproj else None, found.from_cache)


def _download(name: HubName, filename: str, revision: str, endpoint: str, cache: Path, token: str | None,
              cache_only: bool, progress: type | None) -> Path:
    import httpx2
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        return Path(hf_hub_download(name.repo_id, filename, revision=revision, endpoint=endpoint, cache_dir=cache,
                                    token=token, local_files_only=cache_only, tqdm_class=progress))
    except EntryNotFoundError:  # the local kind too: listed in the cache, the blob gone
        raise HubError(f"{filename} of {name.repo_id} is not in the cache {cache}" if cache_only
                       else f"{name.repo_id} lists {filename} but the hub does not serve it") from None
    except (HfHubHTTPError, httpx2.HTTPError, OSError, ValueError) as exc:
        raise HubError(f"downloading {filename} from {name.repo_id} failed: {_one_line(exc)}") from None


# -- what a pull would do, without doing it (check-config) --

@dataclass(frozen=True)
class HubFile:
    filename: str  # inside the repository
    cached: Path | None  # its snapshot path when the cache holds it at the commit that would be used
    size: int | None  # bytes, from the hub's HEAD answer (None: cached, or the hub did not say)
    digest: str | None  # the hub's ETag: a large file's sha256


@dataclass(frozen=True)
class HubLookup:
    name: HubName
    files: tuple[HubFile, ...]  # the model's parts, then the projector
    mmproj: bool  # the last of files is the projector
    cache: Path
    from_cache: bool  # listed from the cache: the hub was not asked
    why_cache: str
    snapshot: Path | None  # the folder the files are (or will be) in; None: the hub named no commit

    @property
    def model_path(self) -> Path | None:
        """The model's path once pulled (where it is now, when the cache holds it)."""
        first = self.files[0]
        return first.cached or (self.snapshot / first.filename if self.snapshot else None)

    @property
    def complete(self) -> bool:
        return all(f.cached is not None for f in self.files)

    @property
    def missing_bytes(self) -> int | None:
        sizes = [f.size for f in self.files if f.cached is None]
        return None if None in sizes else sum(sizes)

    def describe(self) -> str:
        """One line for check-config: found in the cache at PATH, or would download NAME (N bytes) into DIR."""
        if self.complete:
            where = f"found in the cache at {self.files[0].cached}"
            return where + (f" (projector {self.files[-1].cached})" if self.mmproj else "")
        missing = [f.filename for f in self.files if f.cached is None]
        size = f"{self.missing_bytes} bytes" if self.missing_bytes is not None else "size unknown"
        return f"would download {self.name} ({size}: {_listed(missing)}) into {self.cache}"


def lookup(spec: str, hf_file: str | None = None, *, revision: str = "main", endpoint: str | None = None,
           cache_dir: str | Path | None = None, token: str | None = None, offline: bool | None = None,
           with_mmproj: bool = True) -> HubLookup:
    """What `pull` would fetch and what the cache already holds, asking the hub for the listing and each
    missing file's size (HEAD) but downloading nothing. Offline, the cache alone answers, and a model it
    lacks is a HubError (serve would fail the same way)."""
    found = _settle(spec, hf_file, revision, endpoint, cache_dir, token, offline, with_mmproj)
    wanted = found.parts + ([found.mmproj] if found.mmproj else [])
    commit = found.commit or _cached_commit(found.cache, found.name.repo_id, revision)
    files = []
    for filename in wanted:
        cached = _in_snapshot(found.cache, found.name.repo_id, commit, filename)
        size = digest = None
        if cached is None and found.from_cache:
            raise HubError(f"{found.why_cache}, and {filename} of {found.name.repo_id} is not in the cache "
                           f"{found.cache}")
        if cached is None:
            size, digest = _file_metadata(found, filename, revision, token)
        files.append(HubFile(filename, cached, size, digest))
    snapshot = _snapshot_folder(found.cache, found.name.repo_id, commit)
    return HubLookup(found.name, tuple(files), found.mmproj is not None, found.cache, found.from_cache,
                     found.why_cache, snapshot.absolute() if snapshot else None)


def _cached_commit(cache: Path, repo_id: str, revision: str) -> str | None:
    from huggingface_hub.file_download import repo_folder_name

    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    try:
        return (cache / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / revision).read_text().strip()
    except OSError:
        return None


def _snapshot_folder(cache: Path, repo_id: str, commit: str | None) -> Path | None:
    from huggingface_hub.file_download import repo_folder_name

    if commit is None or not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None
    return cache / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / commit


def _in_snapshot(cache: Path, repo_id: str, commit: str | None, filename: str) -> Path | None:
    """The file's snapshot path when the cache holds it whole at `commit` (a link to a present blob)."""
    folder = _snapshot_folder(cache, repo_id, commit)
    path = folder / filename if folder else None
    return path.absolute() if path is not None and path.is_file() else None


def _file_metadata(found: _Listing, filename: str, revision: str, token: str | None) -> tuple[int | None, str | None]:
    """(size, sha256) of a file from the hub's HEAD answer; (None, None) when it cannot say."""
    from urllib.parse import quote

    import httpx2
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.errors import HfHubHTTPError

    # The hub's resolve URL, built here: hf_hub_url swaps in `endpoint` only where its template (made from
    # HF_ENDPOINT at import) still matches the library's current endpoint.
    url = f"{found.endpoint}/{found.name.repo_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"
    try:
        meta = get_hf_file_metadata(url, token=token, endpoint=found.endpoint)
    except (HfHubHTTPError, httpx2.HTTPError, OSError, ValueError):
        return None, None
    etag = (meta.etag or "").strip('"').removeprefix("W/").strip('"')
    return meta.size, etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None


# -- Ollama's /api/pull (daemon/model/hub_ollama_pull.py) --

def pull_for_api(name: Any, settings) -> Iterator[dict[str, Any]]:
    """Ollama's /api/pull from this module's code: progress objects in Ollama's shape (status, digest, total,
    completed; {"error": ...} last on a failure). See daemon/model/hub_ollama_pull.py."""
    from daemon.model.hub_ollama_pull import pull_stream

    return pull_stream(name, settings)
