"""From settings to the fleet's models: each model's own settings, files,
footprint (predicted from its GGUF, or measured at an earlier load), and the
memory budget they share.

Runs before the event loop serves anything (it reads files), and again on
`dormouse check-config`, which prints what it found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from config import Settings
from config.models import MODEL_ID
from daemon.gpu import Nvml
from daemon.model.files import ModelFileError, model_files, state_dir
from daemon.model.footprint import Footprint, predict
from daemon.model.footprint_store import FootprintStore, footprint_key
from daemon.model.gguf_header import GgufError

GPU_RESERVE_BYTES = 2**30  # CUDA context, other processes' small allocations, fragmentation
CPU_SHARE = 0.75  # of the RAM available at start: the rest is the system's and the page cache's


@dataclass
class ModelPlan:
    id: str
    settings: Settings  # the daemon's settings with this model's table applied
    model_path: str
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    is_default: bool = False
    predicted: Footprint | None = None
    predicted_error: str | None = None  # why there is no prediction (then the files' sizes stand in)
    measured: dict[str, int] | None = None  # per component, from an earlier load of the same files and settings
    key: str | None = None  # the footprint store's key
    overrides: dict[str, Any] = field(default_factory=dict)
    hub: str | None = None  # check-config, a model by name: "found in the cache at ..." or "would download ..."

    @property
    def files_present(self) -> bool:
        """False for a model by name that check-config did not download: its files cannot be checked yet."""
        return bool(self.model_path) and Path(self.model_path).is_file()

    @property
    def predicted_bytes(self) -> int:
        if self.predicted is not None:
            return self.predicted.total
        files = [Path(f) for f in (self.model_path, self.settings.model_draft, self.settings.mmproj) if f]
        return sum(f.stat().st_size for f in files if f.is_file())  # at least the weights

    @property
    def load_at_start(self) -> bool:
        """The default model and pinned models load at start; the others on their first request."""
        return self.is_default or self.pinned


def model_plans(settings: Settings, log=None, fetch: bool = True) -> list[ModelPlan]:
    """Each configured model with its settings and checked files. Raises ModelFileError.

    fetch=False (check-config) downloads nothing: a model by name is looked up (the hub's listing and
    sizes, or the cache's), and its plan's `hub` line says what serve would download or found."""
    if not settings.models:
        path, hub = model_files(settings, fetch)
        stem = Path(path).stem  # the id clients see in /v1/models, and a directory name under state_dir/kv
        model_id = stem if MODEL_ID.fullmatch(stem) and stem.strip(".") else "default"
        return [ModelPlan(model_id, settings, path, is_default=True, hub=hub)]
    default = settings.default_model or next(iter(settings.models))
    plans = []
    for model_id, table in settings.models.items():
        overrides = table.overrides()
        own = settings.model_copy(update={**_own_model(settings, table, overrides), "models": {}})
        try:
            path, hub = model_files(own, fetch)
        except ModelFileError as exc:
            raise ModelFileError(f"[models.{model_id}]: {exc}") from None
        plans.append(ModelPlan(model_id, own, path, tuple(table.aliases), table.pinned, model_id == default,
                               overrides=overrides, hub=hub))
    return plans


def configured_as_router(settings: Settings, n_models: int) -> bool:
    """Configured as llama-server's router: several models, a models_dir, or its router options (models_max,
    models_autoload = false) where no single model is named by a top-level model or hf_repo (llama-server is
    a router only when -m and -hf are not given; `-m x.gguf --models-max 2` serves that model). A router's
    /props says role "router", and a request's model name must be one of the fleet's (Fleet.any_name)."""
    if n_models > 1 or settings.models_dir is not None:
        return True
    names_one_model = not settings.models and (settings.model is not None or bool(settings.hf_repo))
    return not names_one_model and (settings.models_max > 0 or not settings.models_autoload)


def _own_model(settings: Settings, table, overrides: dict[str, Any]) -> dict[str, Any]:
    """The table's settings over the top level's. A table that names its own model (path or hf) takes none
    of the top-level model keys (a top-level hf_file belongs to the top-level repository); its llama_options
    are laid over the top-level ones, key by key (a shared flash_attn_type, a model's own rope_freq_base)."""
    update = dict(overrides)
    if table.names_its_own_model():
        update = {"model": None, "hf_repo": None, "hf_file": None, **update}
    if table.llama_options is not None:
        update["llama_options"] = {**settings.llama_options, **table.llama_options}
    return update


def add_footprints(plans: list[ModelPlan], store: FootprintStore | None, log=None) -> None:
    """Predict each model's footprint from its GGUF and pick up what an earlier load measured."""
    for plan in plans:
        s = plan.settings
        try:
            plan.predicted = predict(plan.model_path, ctx_size=s.ctx_size, parallel=s.parallel, model_draft=s.model_draft,
                                     mmproj=s.mmproj, n_gpu_layers=s.n_gpu_layers, batch_size=s.batch_size,
                                     draft_max=s.draft_max, embeddings=s.embeddings,
                                     prompt_cache=s.kv_cache_disk_bytes > 0, kv_unified=s.kv_unified)
        except (GgufError, ValueError, OSError) as exc:
            plan.predicted_error = str(exc)
            if log is not None:
                log.warning("fleet.no_prediction", model=plan.id, error=str(exc))
        if store is not None:
            try:
                plan.key = footprint_key(plan.model_path, s.ctx_size, s.parallel, model_draft=s.model_draft,
                                         mmproj=s.mmproj, n_gpu_layers=s.n_gpu_layers, batch_size=s.batch_size,
                                         draft_max=s.draft_max, embeddings=s.embeddings, kv_unified=s.kv_unified)
            except OSError:
                continue
            plan.measured = store.get(plan.key)  # judged where it is used (server._stands, check-config)


def footprint_store(settings: Settings, log=None) -> FootprintStore:
    return FootprintStore(state_dir(settings), logger=log)


@dataclass(frozen=True)
class Budget:
    bytes: int
    how: str  # where the number came from, for check-config and the log


def memory_budget(settings: Settings, nvml: Nvml | None = None) -> Budget:
    if settings.memory_budget is not None:
        return Budget(settings.memory_budget, "memory_budget setting")
    nvml = nvml or Nvml()
    totals = nvml.total_memory()
    if totals and settings.n_gpu_layers != 0:
        # The models live on the GPU: its memory less a reserve. (Several GPUs: the
        # first one's; a model split across cards is planned as if on one.)
        total = totals[0]
        return Budget(max(total - GPU_RESERVE_BYTES, total // 2), f"GPU 0 total {total} bytes less a 1 GiB reserve")
    available = psutil.virtual_memory().available
    return Budget(int(available * CPU_SHARE), f"{int(CPU_SHARE * 100)}% of the {available} bytes of RAM available at start")
