"""A model by name in the fleet's tables: `[models.X] hf = "owner/repo:QUANT"` (and hf_file), one clear error
for a table that names two models, a top-level hf_repo no table takes refused rather than dropped, and a
table's own llama_options laid over the top-level ones. Nothing here asks a hub: the files are local."""

from __future__ import annotations

import pytest

from config import ConfigError, load_settings
from daemon.fleet.plans import _own_model, model_plans


def _load(tmp_path, text: str, cli: dict | None = None):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return load_settings(path, cli)


def test_a_table_names_its_model_by_hf(tmp_path):
    s = _load(tmp_path, '[models.chat]\nhf = "hf.co/ggml-org/gemma-3-1b-it-GGUF:q4_k_m"\n'
                        'hf_file = "gemma-3-1b-it-Q4_K_M.gguf"\nctx_size = 2048\n')
    table = s.models["chat"]
    assert table.hf == "ggml-org/gemma-3-1b-it-GGUF:q4_k_m"  # the hf.co/ prefix dropped, as parse_hf_repo reads it
    assert table.overrides() == {"ctx_size": 2048, "hf_repo": "ggml-org/gemma-3-1b-it-GGUF:q4_k_m",
                                 "hf_file": "gemma-3-1b-it-Q4_K_M.gguf"}


@pytest.mark.parametrize("table, needle", [
    ('path = "/m/a.gguf"\nhf = "o/r:Q4_K_M"', "path and hf are both set"),
    ('hf_file = "a.gguf"', "hf_file names a file of the table's hf repository, and the table sets no hf"),
    ('path = "/m/a.gguf"\nhf_file = "a.gguf"', "the table sets no hf"),
    ('hf = "../../etc/passwd"', "is not a repository"),
    ('hf = "o/r:../x"', "the quant tag after ':'"),
    ('hf = 12', "models.chat.hf"),
    ('hf = ["o/r"]', "models.chat.hf"),
    (f'hf = "{"x" * 100_000}"', "models.chat.hf"),
    ('hf = "o/r"\nhf_file = "../../secrets.gguf"', "is not a relative path inside the repository"),
    ('hf = "o/r"\nhf_file = "notes.txt"', "is not a .gguf file"),
    (f'hf = "o/r"\nhf_file = "{"y" * 5000}.gguf"', "models.chat.hf_file"),
    ('llama_options = { no_such_knob = 1 }', "no_such_knob"),
    ('llama_options = { n_ubatch = -5 }', "n_ubatch"),
    ('llama_options = "fast"', "models.chat.llama_options"),
])
def test_a_bad_table_fails_the_load_in_one_line_naming_it(tmp_path, table, needle):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, f"[models.chat]\n{table}\n")
    message = str(info.value)
    assert needle in message and "models.chat" in message, message
    assert len(message) < 1200


@pytest.mark.parametrize("top", ['hf_repo = "ggml-org/gemma-3-1b-it-GGUF"', 'hf_file = "gemma-3-1b-it-Q4_K_M.gguf"'])
def test_a_top_level_hf_repo_no_table_takes_is_refused_not_dropped(tmp_path, top):
    text = f'{top}\n[models.a]\npath = "/m/a.gguf"\n[models.b]\nhf = "o/r:Q8_0"\n'
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    key = top.split(" ")[0]
    assert f"{key} = " in str(info.value) and "is served by no model" in str(info.value)
    assert "(from config file" in str(info.value) and "Move it into a table of its own" in str(info.value)


def test_the_same_from_the_environment_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("DORMOUSE_HF_REPO", "ggml-org/gemma-3-1b-it-GGUF")
    with pytest.raises(ConfigError, match="from environment DORMOUSE_HF_REPO"):
        _load(tmp_path, '[models.a]\nhf = "o/r"\n')


def test_a_top_level_hf_repo_is_inherited_by_a_table_that_names_none(tmp_path):
    s = _load(tmp_path, 'hf_repo = "o/shared-GGUF:Q8_0"\n[models.a]\nctx_size = 1024\n[models.b]\npath = "/m/b.gguf"\n')
    inherited = s.model_copy(update=_own_model(s, s.models["a"], s.models["a"].overrides()))
    assert inherited.hf_repo == "o/shared-GGUF:Q8_0" and inherited.ctx_size == 1024
    own = s.model_copy(update=_own_model(s, s.models["b"], s.models["b"].overrides()))
    # b's own path: the top-level repository is not b's too (no "model and hf_repo are both set")
    assert own.hf_repo is None and own.hf_file is None and str(own.model) == "/m/b.gguf"


def test_a_table_with_hf_drops_the_top_level_model_and_hf_file(tmp_path):
    s = _load(tmp_path, 'model = "/m/top.gguf"\n[models.a]\nhf = "o/r"\n[models.b]\nctx_size = 512\n')
    own = s.model_copy(update=_own_model(s, s.models["a"], s.models["a"].overrides()))
    assert own.model is None and own.hf_repo == "o/r" and own.hf_file is None


def test_llama_options_per_table_lie_over_the_top_level_ones(tmp_path, tiny_model):
    s = _load(tmp_path, f'model = "{tiny_model}"\n[llama_options]\nflash_attn_type = 0\nn_ubatch = 256\n'
                        f'[models.a]\n[models.a.llama_options]\nn_ubatch = 64\nrope_freq_base = 20000.0\n'
                        f'[models.b]\nctx_size = 512\n')
    plans = {plan.id: plan for plan in model_plans(s)}
    assert plans["a"].settings.llama_options == {"flash_attn_type": 0, "n_ubatch": 64, "rope_freq_base": 20000.0}
    assert plans["b"].settings.llama_options == {"flash_attn_type": 0, "n_ubatch": 256}
    assert s.llama_options == {"flash_attn_type": 0, "n_ubatch": 256}  # the top level itself untouched


def test_the_worker_receives_a_tables_own_llama_options(tmp_path, tiny_model):
    from types import SimpleNamespace

    from daemon.model.controller import Controller

    s = _load(tmp_path, f'model = "{tiny_model}"\nllama_options = {{ n_ubatch = 128 }}\n'
                        f'[models.a]\nllama_options = {{ type_k = 8 }}\n[models.b]\n')
    specs = {}
    for plan in model_plans(s):  # the spec the controller sends the worker, from the plan's settings
        fake = SimpleNamespace(settings=plan.settings, model_path=plan.model_path, kv_dir=tmp_path / "kv",
                               model_id=plan.id)
        specs[plan.id] = Controller._model_spec(fake, warmup=False)
    assert specs["a"].llama_options == {"n_ubatch": 128, "type_k": 8}
    assert specs["b"].llama_options == {"n_ubatch": 128}


@pytest.fixture
def tiny_model(tmp_path):
    from tests.fixtures.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path / "tiny.gguf")
