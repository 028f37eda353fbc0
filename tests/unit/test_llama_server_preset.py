"""--models-preset: llama-server's INI presets read as [models.ID] tables, its README's own example
first; every key a preset may not set is refused naming the section and the key."""

from __future__ import annotations

import pytest

from config.settings import Settings
from daemon.llama_server_args import LlamaServerArgsError, translate

README_EXAMPLE = """version = 1

; (Optional) This section provides global settings shared across all presets.
[*]
c = 8192
n-gpu-layers = 8

[my-model]
; string value
chat-template = chatml
; numeric value
n-gpu-layers = 123
; flag value (for certain flags, you need to use the "no-" prefix for negation)
jinja = true
; shorthand argument (for example, context size)
c = 4096
; environment variable name
LLAMA_ARG_FLASH_ATTN = on
model-draft = /srv/my-models/draft.gguf
model = /srv/my-awesome-model-Q4_K_M.gguf

[custom_model]
model = /Users/abc/my-awesome-model-Q4_K_M.gguf
alias = gpt-4o-mini,mini
"""


def preset(tmp_path, text: str, *more: str, environ=None):
    path = tmp_path / "presets.ini"
    path.write_text(text)
    return translate(["--models-preset", str(path), *more], environ or {}, {})


def test_the_readmes_example_becomes_tables_the_settings_take(tmp_path):
    t = preset(tmp_path, README_EXAMPLE)
    assert t.settings["models"] == {
        "my-model": {"ctx_size": 4096, "n_gpu_layers": 123, "chat_template": "chatml",
                     "model_draft": "/srv/my-models/draft.gguf", "path": "/srv/my-awesome-model-Q4_K_M.gguf",
                     "llama_options": {"flash_attn_type": 1}},
        "custom_model": {"path": "/Users/abc/my-awesome-model-Q4_K_M.gguf", "aliases": ["gpt-4o-mini", "mini"]},
    }
    # [*] is the router's command line: the daemon's settings, which every table inherits.
    assert (t.settings["ctx_size"], t.settings["n_gpu_layers"]) == (8192, 8)
    settings = Settings(**t.serve_settings())
    assert settings.ctx_size == 8192 and settings.models["my-model"].ctx_size == 4096
    assert settings.models["custom_model"].aliases == ["gpt-4o-mini", "mini"]
    assert settings.models["my-model"].llama_options == {"flash_attn_type": 1}
    assert any("[my-model]" in note and "--jinja" in note for note in t.notes)  # accepted, and said


def test_the_common_section_is_the_routers_command_line_under_the_real_one(tmp_path):
    text = "[*]\nLLAMA_ARG_CACHE_RAM = 0\nport = 9001\nc = 1024\n\n[a]\nmodel = /m/a.gguf\n"
    t = preset(tmp_path, text)
    assert t.settings["prompt_cache_ram_bytes"] == 0 and t.settings["port"] == 9001
    assert t.settings["models"] == {"a": {"path": "/m/a.gguf"}} and t.settings["ctx_size"] == 1024
    later = preset(tmp_path, text, "--port", "9002", "-c", "512")
    assert (later.settings["port"], later.settings["ctx_size"]) == (9002, 512)
    earlier = translate(["-c", "512", "--models-preset", str(tmp_path / "presets.ini")], {}, {})
    assert earlier.settings["ctx_size"] == 512  # before or after it, the command line wins over [*]


@pytest.mark.parametrize("text, named", [
    ("[a]\nmodel = /m/a.gguf\nport = 9001\n", "[a]: --port sets `port`, which is the daemon's"),
    ("[a]\nmodel = /m/a.gguf\nno-such-option = 1\n", "[a]: no-such-option is not an option of llama-server"),
    ("[a]\nc = 1024\n", "[a]: names no model"),
    ("[a]\nmodel = /m/a.gguf\nload-on-startup = true\n", "[a]: load-on-startup"),
    ("[a]\nmodel = /m/a.gguf\njinja = maybe\n", "[a]: jinja: expects on/off"),
    ("[a]\nmodel = /m/a.gguf\nlora = /x.gguf\n", "[a]: --lora is not supported"),
    ("[a]\nmodel = /m/a.gguf\nc = -5x\n", "[a]"),
    ("version = 1\n", "has no model section"),
    ("[a]\nmodel = /m/a.gguf\nmodels-preset = presets.ini\n", "[a]: models-preset: a preset cannot name another"),
    ("[*]\nLLAMA_ARG_MODELS_PRESET = presets.ini\n[a]\nmodel = /m/a.gguf\n", "a preset cannot name another"),
    ("[a]\nmodel = /m/a.gguf\nload-on-startup = maybe\n", "[a]: load-on-startup: expects on/off"),
    ("[a]\nmodel = /m/a.gguf\nLLAMA_ARG_NO_SUCH = 1\n", "[a]: LLAMA_ARG_NO_SUCH is not a variable"),
    ("[a]\nmodel = /m/a.gguf\n[a]\nmodel = /m/b.gguf\n", "is not an INI file"),
    ("not an ini line\n", "is not an INI file"),
])
def test_a_preset_that_cannot_be_honoured_is_refused_naming_the_place(tmp_path, text, named):
    with pytest.raises(LlamaServerArgsError) as refused:
        preset(tmp_path, text)
    assert named in str(refused.value) and "--models-preset" in str(refused.value)


def test_an_unreadable_huge_or_binary_file_is_refused(tmp_path):
    for content in (b"\xff\xfe\x00binary", b"[a]\nmodel = /m/a.gguf\n" + b";" * (1 << 20)):
        (tmp_path / "p.ini").write_bytes(content)
        with pytest.raises(LlamaServerArgsError, match="p.ini"):
            translate(["--models-preset", str(tmp_path / "p.ini")], {}, {})
    with pytest.raises(LlamaServerArgsError, match="cannot read"):
        translate(["--models-preset", str(tmp_path / "absent.ini")], {}, {})


def test_router_names_are_ids_and_an_id_the_fleet_cannot_take_is_refused_by_the_settings(tmp_path):
    t = preset(tmp_path, "[ggml-org/gemma:Q8_0]\nmodel = /m/a.gguf\n")  # llama-server router's naming
    assert list(Settings(**t.serve_settings()).models) == ["ggml-org/gemma:Q8_0"]
    for section in ("../gemma", "a b", "org//gemma", "org/"):
        t = preset(tmp_path, f"[{section}]\nmodel = /m/a.gguf\n")
        with pytest.raises(ValueError, match="model id"):
            Settings(**t.serve_settings())


def test_the_common_sections_options_are_read_together_and_an_alias_keeps_the_presets_models(tmp_path):
    text = "v = 2\n[*]\nmmap = false\nmlock = true\n\n[a]\nmodel = /m/a.gguf\n"
    t = preset(tmp_path, text)
    assert t.settings["load_mode"] == "mlock"  # as llama-server reads the pair, in either order
    flipped = preset(tmp_path, text.replace("mmap = false\nmlock = true", "mlock = true\nmmap = false"))
    assert flipped.settings["load_mode"] == "mlock"
    assert any("v before the first section" in note for note in t.notes)
    for argv in (["-a", "chat"], []):  # an alias before or after the preset: its models stay
        path = str(tmp_path / "presets.ini")
        both = translate([*argv, "--models-preset", path, *(["-a", "chat"] if not argv else [])], {}, {})
        assert set(both.settings["models"]) == {"a", "chat"}


def test_a_preset_that_refers_to_itself_is_one_error_not_a_recursion(tmp_path):
    path = tmp_path / "self.ini"
    path.write_text(f"[a]\nmodel = /m/a.gguf\n[*]\nmodels-preset = {path}\n")
    with pytest.raises(LlamaServerArgsError, match="a preset cannot name another"):
        translate(["--models-preset", str(path)], {}, {})



def test_a_models_recommended_sampling_in_its_section_is_that_models_default(tmp_path):
    # llama-server presets carry each model's sampling (Qwen3: temp 0.6, top-k 20); [*]'s is every model's
    text = ("[*]\ntop-k = 30\n\n[qwen]\nmodel = /m/q.gguf\ntemp = 0.6\ntop-k = 20\nLLAMA_ARG_TOP_P = 0.95\nmin-p = 0\n"
            "presence-penalty = 1.5\nn-predict = 512\n\n[plain]\nmodel = /m/p.gguf\n")
    t = preset(tmp_path, text)
    assert t.settings["models"]["qwen"] == {"path": "/m/q.gguf", "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                            "min_p": 0.0, "presence_penalty": 1.5, "n_predict": 512}
    settings = Settings(**t.serve_settings())
    assert settings.top_k == 30 and settings.models["plain"].top_k is None  # the top level's applies to it
    with pytest.raises(ValueError, match="top_k"):
        Settings(**preset(tmp_path, "[qwen]\nmodel = /m/q.gguf\ntop-k = -2\n").serve_settings())
    with pytest.raises(ValueError, match="n_predict"):
        Settings(**preset(tmp_path, "[qwen]\nmodel = /m/q.gguf\nn-predict = 0\n").serve_settings())
