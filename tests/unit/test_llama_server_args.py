"""llama-server's command line and LLAMA_ARG_* variables for `dormouse serve` (issue 29, first item):
every option of the snapshot is handled, every spelling and variable translates, mapped options
reach their setting, refused ones say why, and hostile input gives one clear error."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from config import load_settings
from config.llama_options import LLAMA_PARAM_FIELDS, WORKER_OWNED, check_llama_options
from daemon import llama_server_args as lsa
from daemon.llama_server_args import LlamaServerArgsError, translate
from daemon.llama_server_options import LLAMA_CPP_COMMIT, OPTIONS

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = json.loads((ROOT / "tests/fixtures/llama_server_options.json").read_text())

# A valid value for each option that takes one (by its first spelling), and what it must produce:
# {"setting": value} pairs, or {"llama_options.x": value}. Options left out take "4" and are refused.
SAMPLES: dict[str, tuple[str, dict]] = {
    "-t": ("3", {"threads": 3}),
    "-tb": ("2", {"llama_options.n_threads_batch": 2}),
    "-c": ("2048", {"ctx_size": 2048}),
    "-n": ("-2", {"n_predict": -1}),
    "-b": ("256", {"batch_size": 256}),
    "-ub": ("64", {"llama_options.n_ubatch": 64}),
    "-cram": ("16", {"prompt_cache_ram_bytes": 16 * 2**20}),
    "-fa": ("auto", {"llama_options.flash_attn_type": -1}),
    "-s": ("4294967295", {"seed": -1}),
    "--temp": ("0.25", {"temperature": 0.25}),
    "--top-k": ("20", {"top_k": 20}),
    "--top-p": ("0.8", {"top_p": 0.8}),
    "--min-p": ("0", {"min_p": 0.0}),
    "--repeat-penalty": ("1.1", {"repeat_penalty": 1.1}),
    "--repeat-last-n": ("-1", {"repeat_last_n": -1}),
    "--presence-penalty": ("1.5", {"presence_penalty": 1.5}),
    "--frequency-penalty": ("-0.5", {"frequency_penalty": -0.5}),
    "--pooling": ("cls", {"pooling": "cls"}),
    "--rope-scaling": ("yarn", {"llama_options.rope_scaling_type": 2}),
    "--rope-scale": ("4", {"llama_options.rope_freq_scale": 0.25}),
    "--rope-freq-base": ("10000.5", {"llama_options.rope_freq_base": 10000.5}),
    "--rope-freq-scale": ("0.5", {"llama_options.rope_freq_scale": 0.5}),
    "--yarn-orig-ctx": ("8192", {"llama_options.yarn_orig_ctx": 8192}),
    "--yarn-ext-factor": ("1", {"llama_options.yarn_ext_factor": 1.0}),
    "--yarn-attn-factor": ("1.5", {"llama_options.yarn_attn_factor": 1.5}),
    "--yarn-beta-slow": ("1", {"llama_options.yarn_beta_slow": 1.0}),
    "--yarn-beta-fast": ("32", {"llama_options.yarn_beta_fast": 32.0}),
    "-ctk": ("q8_0", {"llama_options.type_k": 8}),
    "-ctv": ("bf16", {"llama_options.type_v": 30}),
    "-dt": ("0.1", {"llama_options.defrag_thold": 0.1}),
    "-np": ("3", {"parallel": 3}),
    "-mm": ("/models/p.gguf", {"mmproj": "/models/p.gguf"}),
    "-lm": ("dio", {"load_mode": "direct_io"}),
    "-lzm": ("on", {"llama_options.lazy_mode": 2}),
    "-ngl": ("all", {"n_gpu_layers": -1}),
    "-sm": ("row", {"llama_options.split_mode": 2}),
    "--tools": ("read_file,get_info", {"tools": ["read_file", "get_info"]}),
    "--tools-runtime": ("ssh:me@box", {"tools_runtime": "ssh:me@box"}),
    "--mcp-servers-json": ('{"mcpServers": {"e": {"command": "x"}, "no_command": {}}}', {"mcp_servers": {
        "e": {"command": "x"}}}),
    "--mcp-servers-config": (str(ROOT / "tests/fixtures/mcp_servers/echo.json"), {"mcp_servers": {"echo": {
        "command": "python3", "args": ["tests/fixtures/mcp_servers/fake_mcp_server.py"], "timeout_ms": 5000}}}),
    "-mg": ("1", {"llama_options.main_gpu": 1}),
    "-fit": ("off", {}),
    "--api-key-file": ("/dev/null", {}),
    "-a": ("chat, gpt-4o", {"models": {"chat": {"aliases": ["gpt-4o"]}}}),
    "--tags": ("a, b", {"tags": ["a", "b"]}),
    "-m": ("/models/m.gguf", {"model": "/models/m.gguf"}),
    "-hf": ("ggml-org/gemma-3-270m-GGUF:Q8_0", {"hf_repo": "ggml-org/gemma-3-270m-GGUF:Q8_0"}),
    "-hff": ("model.gguf", {"hf_file": "model.gguf"}),
    "--host": ("0.0.0.0", {"host": "0.0.0.0"}),
    "--port": ("9000", {"port": 9000}),
    "--cors-origins": ("https://a.example, https://b.example", {"cors_origins": ["https://a.example",
                                                                                  "https://b.example"]}),
    "--api-key": ("k1", {"api_key": "k1"}),
    "--threads-http": ("8", {}),
    "--cache-reuse": ("256", {}),
    "--slot-save-path": ("/var/slots", {"slot_save_path": "/var/slots"}),
    "--models-dir": ("/srv/models", {"models_dir": "/srv/models"}),
    "--models-preset": (str(Path(__file__).parents[1] / "fixtures" / "router_preset.ini"),
                        {"ctx_size": 2048, "models": {"chat": {"path": "/models/chat.gguf"}}}),
    "--models-max": ("2", {"models_max": 2}),
    "--chat-template": ("chatml", {"chat_template": "chatml"}),
    "--chat-template-file": ("/t.jinja", {"chat_template_file": "/t.jinja"}),
    "--chat-template-kwargs": ('{"enable_thinking": false, "tone": "dry"}',
                               {"chat_template_kwargs": {"enable_thinking": False, "tone": "dry"}}),
    "-rea": ("auto", {}),  # off: tests/unit/test_llama_server_reasoning.py
    "--reasoning-budget": ("-1", {}),
    "--sleep-idle-seconds": ("2.5", {"sleep_idle_seconds": 2.5}),
    "--log-colors": ("auto", {}),
    "-lv": ("4", {"log_level": "debug"}),
    "--spec-draft-n-max": ("8", {"draft_max": 8}),
    "--spec-draft-n-min": ("2", {"draft_min": 2}),
    "--spec-draft-p-min": ("0.5", {"draft_p_min": 0.5}),
    "--spec-draft-model": ("/models/d.gguf", {"model_draft": "/models/d.gguf"}),
    "--draft": ("6", {"draft_max": 6}),
    "--draft-min": ("1", {"draft_min": 1}),
    "--spec-type": ("none", {}),
}
# What a flag or switch must produce: (positive effect, negative effect); None: refused.
SWITCHES: dict[str, tuple[dict | None, dict | None]] = {
    "--warmup": ({"warmup": True}, {"warmup": False}),
    "--repack": ({"cpu_repack": True}, {"cpu_repack": False}),
    "-kvo": ({"llama_options.offload_kqv": True}, {"llama_options.offload_kqv": False}),
    "--op-offload": ({"llama_options.op_offload": True}, {"llama_options.op_offload": False}),
    "--no-host": ({"llama_options.no_host": True}, None),
    "--check-tensors": ({"llama_options.check_tensors": True}, None),
    "--embedding": ({"embeddings": True}, None),
    "--rerank": ({"embeddings": True, "pooling": "rank"}, None),
    "--log-disable": ({"log_level": "error"}, None),
    "-v": ({"log_level": "debug", "verbose_answers": True}, None),
    "--log-jsonl": ({"log_format": "json"}, {"log_format": "console"}),
    "--jinja": ({}, None),
    "--metrics": ({"metrics_endpoint": True, "metrics_compat": ["llamacpp"]}, None),
    "--models-autoload": ({"models_autoload": True}, {"models_autoload": False}),
    "--slots": ({"slots_endpoint": True}, {"slots_endpoint": False}),
    "--ui": ({"status_page": True}, {"status_page": False}),
    "-kvu": ({"kv_unified": True}, {"kv_unified": False}),
    "--context-shift": (None, {}),
    "-cb": ({}, None),
    "--swa-full": ({}, None),
    "-ag": ({"tools": ["all"], "cors_proxy": True}, {"tools": [], "cors_proxy": False}),
    "--ui-mcp-proxy": ({"cors_proxy": True}, {"cors_proxy": False}),
}
NO_DORMOUSE_FLAGS: dict[str, bool] = {}  # translate() alone, without dormouse serve's own flags


def effect(t: lsa.Translation) -> dict:
    out = {key: (str(v) if isinstance(v, Path) else v) for key, v in t.settings.items()}
    out.update({f"llama_options.{k}": v for k, v in t.llama_options.items()})
    return out


def value_for(option) -> str:
    return SAMPLES.get(option.spellings[0], ("4", None))[0]


def argv_for(option, spelling: str) -> list[str]:
    if option.takes in ("flag", "switch"):
        return [spelling]
    return [spelling, value_for(option)] + ([value_for(option)] if option.takes == "two" else [])


# -- the table against the snapshot of llama.cpp's arg.cpp --

def test_the_snapshot_names_the_vendored_llama_cpp_and_the_table_covers_it_exactly():
    assert SNAPSHOT["llama_cpp_commit"] == LLAMA_CPP_COMMIT and SNAPSHOT["llama_cpp_python"] == "0.3.36"
    snapshot = {tuple(o["args"]): o for o in SNAPSHOT["options"]}
    table = {option.spellings: option for option in OPTIONS}
    assert len(snapshot) == len(SNAPSHOT["options"]) > 250
    assert set(table) == set(snapshot), (set(table) ^ set(snapshot))
    for spellings, entry in snapshot.items():
        option = table[spellings]
        assert list(option.negative) == entry["negative"], spellings
        assert option.env == entry["env"], spellings
        assert option.takes == entry["type"], spellings
        assert option.does.kind in ("mapped", "llama.cpp", "accepted", "refused", "dormouse") or "/" in \
            option.does.kind, spellings


def test_no_spelling_or_variable_belongs_to_two_options():
    spellings = [s for option in OPTIONS for s in option.spellings + option.negative]
    assert len(spellings) == len(set(spellings))
    envs = [option.env for option in OPTIONS if option.env]
    assert len(envs) == len(set(envs))


# -- every spelling, every variable --

def kind_of(option, positive: bool) -> str:
    """What the table says it does with this spelling: a switch's side; -fit by its sample value."""
    kind = option.does.side(positive).kind
    if "/" in kind:  # chosen by value: -fit off is the sample, accepted
        return "accepted"
    return kind


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.spellings[0])
def test_every_spelling_translates_or_is_refused_naming_itself(option):
    expected = SAMPLES.get(option.spellings[0], (None, None))[1]
    positive_effect, negative_effect = SWITCHES.get(option.spellings[0], (expected, expected))
    for spelling in option.spellings + option.negative:
        positive = spelling not in option.negative
        kind = kind_of(option, positive)
        want = positive_effect if positive else negative_effect
        argv = argv_for(option, spelling)
        if kind == "refused":
            assert spelling not in SWITCHES or want is None, spelling
            with pytest.raises(LlamaServerArgsError) as refused:
                translate(argv, {}, NO_DORMOUSE_FLAGS)
            message = str(refused.value)
            reason = option.does.side(positive).doc.removeprefix("refused: ")
            assert message == f"{spelling} is not supported: {reason}", message
            continue
        t = translate(argv, {}, NO_DORMOUSE_FLAGS)
        if kind == "dormouse":
            assert t.rest == ["--help"] and not t.settings
        elif kind == "accepted":
            assert t.notes and t.notes[0].startswith(f"{spelling}: accepted;") and not effect(t), t.notes
        else:  # mapped or passed to llama.cpp: the sample's effect, exactly
            assert want is not None, f"{spelling}: add a sample and its effect"
            assert effect(t) == want, spelling
            if kind == "llama.cpp":
                assert set(t.llama_options) and not t.settings
                assert load_settings(None, t.serve_settings()).llama_options == t.llama_options


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.env], ids=lambda o: o.env)
def test_every_variable_translates_as_its_option_does(option):
    value = "1" if option.takes in ("flag", "switch") else value_for(option)
    sides = [(option.env, True)]
    if option.negative:  # LLAMA_ARG_NO_X, set at all, turns the switch off
        sides.append((option.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1), False))
    for name, positive in sides:
        handling = option.env_does or option.does
        if kind_of(option, positive) == "refused" and option.env_does is None:
            with pytest.raises(LlamaServerArgsError, match=f"^environment {name} is not supported"):
                translate([], {name: value}, NO_DORMOUSE_FLAGS)
            continue
        from_env = translate([], {name: value}, NO_DORMOUSE_FLAGS)
        if option.env_does is not None:
            assert from_env.notes == [f"environment {name}: accepted; {handling.doc.removeprefix('accepted: ')}"]
            continue
        spelling = option.spellings[0] if positive else option.negative[0]
        from_argv = translate(argv_for(option, spelling), {}, NO_DORMOUSE_FLAGS)
        assert effect(from_env) == effect(from_argv), name
        assert len(from_env.notes) == len(from_argv.notes)


def test_a_mapped_command_line_is_valid_dormouse_settings(tmp_path):
    t = translate(["-m", "/models/m.gguf", "-c", "2048", "-np", "2", "-t", "2", "-b", "128", "-ngl", "auto",
                   "--host", "127.0.0.1", "--port", "8181", "--jinja", "-fa", "on", "-ctk", "q8_0", "--embeddings",
                   "--pooling", "last", "-a", "emb", "--sleep-idle-seconds", "30", "--api-key", "k1,k2"],
                  {}, NO_DORMOUSE_FLAGS)
    settings = load_settings(None, t.serve_settings())
    assert (settings.ctx_size, settings.parallel, settings.threads, settings.batch_size) == (2048, 2, 2, 128)
    assert settings.n_gpu_layers == -1 and settings.embeddings and settings.pooling == "last"
    assert settings.llama_options == {"flash_attn_type": 1, "type_k": 8}
    assert list(settings.models) == ["emb"] and settings.port == 8181 and settings.sleep_idle_seconds == 30
    assert {n: k.get_secret_value() for n, k in settings.api_keys.items()} == {"key1": "k1", "key2": "k2"}


# -- as llama.cpp parses --

def test_the_command_line_wins_over_the_environment_and_the_last_repeat_wins():
    t = translate(["-c", "1024", "--ctx-size", "2048"], {"LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2"},
                  NO_DORMOUSE_FLAGS)
    assert t.settings["ctx_size"] == 2048 and t.settings["parallel"] == 2
    assert any("LLAMA_ARG_CTX_SIZE" in note for note in t.notes)


def test_underscores_and_equals_in_long_options():
    t = translate(["--ctx_size", "512", "--n-gpu-layers=12", "--no_warmup"], {}, NO_DORMOUSE_FLAGS)
    assert effect(t) == {"ctx_size": 512, "n_gpu_layers": 12, "warmup": False}


def test_a_flag_variable_that_is_false_leaves_the_flag_unset_and_an_unknown_variable_is_noted():
    t = translate([], {"LLAMA_ARG_EMBEDDINGS": "false", "LLAMA_ARG_NOT_A_THING": "1", "PATH": "/bin"},
                  NO_DORMOUSE_FLAGS)
    assert t.settings == {} and any("LLAMA_ARG_NOT_A_THING" in n for n in t.notes) and len(t.notes) == 1


def test_api_keys_from_the_option_and_the_file_add_up(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk2\n\nk3\n")
    t = translate(["--api-key", '"k,1"', "--api-key-file", str(keys)], {}, NO_DORMOUSE_FLAGS)
    assert t.settings == {"api_keys": {"key1": "k,1", "key2": "k2", "key3": "k3"}}


def test_context_zero_reads_the_models_trained_context(bundled_model):
    from daemon.model.gguf_header import read_header

    meta = read_header(bundled_model).metadata
    trained = meta[f"{meta['general.architecture']}.context_length"]
    assert translate(["-c", "0", "-m", bundled_model], {}, NO_DORMOUSE_FLAGS).settings["ctx_size"] == trained
    with pytest.raises(LlamaServerArgsError, match="needs the model file"):
        translate(["-c", "0"], {}, NO_DORMOUSE_FLAGS)


def test_dormouse_serve_flags_pass_through_untouched():
    t = translate(["--config", "/etc/d.toml", "-m", "x.gguf", "--admin-key", "secret", "--drowsy-after", "-1",
                   "--spawn-ahead", "--memory-budget=2GiB"], {})
    assert t.rest == ["--config", "/etc/d.toml", "--admin-key", "secret", "--drowsy-after", "-1", "--spawn-ahead",
                      "--memory-budget=2GiB"]
    assert t.settings == {"model": "x.gguf"}


# -- hostile input: one clear error each --

@pytest.mark.parametrize("argv, message", [
    (["--frobnicate"], "--frobnicate: not an option of llama-server"),
    (["model.gguf"], "unexpected argument 'model.gguf'"),
    (["-c"], "-c expects a value"),
    (["--control-vector-layer-range", "1"], "expects a value"),
    (["-c", "abc"], "-c: expects an integer, got 'abc'"),
    (["-c", "12abc"], "expects an integer"),
    (["-c", "1e9"], "expects an integer"),
    (["-c", "9" * 30], "expects an integer"),
    (["-c", "99999999999"], "out of range"),
    (["-c", "-5"], "must be 0"),
    (["-np", "0"], "must be 1 or more"),
    (["-np", "-7"], "must be 1 or more"),
    (["-ngl", "lots"], "expects an integer"),
    (["-ngl", "-3"], "expects a number of layers"),
    (["-fa", "maybe"], "expects on, off or auto"),
    (["-ctk", "q3_k"], "expects one of f32, f16"),
    (["--temp", "nan"], "finite"),
    (["--temp", "1e999"], "finite"),
    (["--rope-scale", "0"], "must not be 0"),
    (["-s", "-2"], "out of range"),
    (["-s", str(2**32)], "out of range"),
    (["-cram", "-1"], "no limit"),
    (["--pooling", "max"], "expects none, mean"),
    (["--pooling", "NONE"], "expects none, mean"),
    (["--host", "/run/llama.sock"], "unix socket"),
    (["-a", " , "], "one or more names"),
    (["--warmup=yes"], "takes no value"),
    (["-ub", "0"], "must be 1 or more"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read"),
    (["-c", "x" * (2 << 20)], "longer than"),
    (["--mirostat", "2"], "--mirostat is not supported: Dormouse's sampler chain is penalties, top-k"),
    (["--ignore-eos"], "--ignore-eos is not supported: no server-wide default for it: send it in each request"),
    (["--frequency-penalty", "nan"], "finite"), (["--top-p", "high"], "--top-p: expects a number"),
    (["--top-k", "0.5"], "--top-k: expects an integer"),
    (["--spec-type", "ngram-mod"], "--spec-type 'ngram-mod' is not supported: Dormouse's speculation is draft-simple"),
    (["--spec-type", "draft-simple,ngram-cache"], "'ngram-cache' is not supported"),
    (["--spec-type", " , "], "' , ' is not supported"),
])
def test_hostile_command_lines_give_one_clear_error(argv, message):
    with pytest.raises(LlamaServerArgsError) as error:
        translate(argv, {}, NO_DORMOUSE_FLAGS)
    assert message in str(error.value) and len(str(error.value)) < 400


@pytest.mark.parametrize("environ, message", [
    ({"LLAMA_ARG_CTX_SIZE": "big"}, "environment LLAMA_ARG_CTX_SIZE: expects an integer"),
    ({"LLAMA_ARG_EMBEDDINGS": "maybe"}, "environment LLAMA_ARG_EMBEDDINGS: expects on/off"),
    ({"LLAMA_ARG_WARMUP_X": "1", "LLAMA_ARG_N_PARALLEL": "2" * 40}, "expects an integer"),
    ({"LLAMA_ARG_CTX_CHECKPOINTS": "5"}, "environment LLAMA_ARG_CTX_CHECKPOINTS is not supported"),
    ({"LLAMA_ARG_TOP_K": "few"}, "environment LLAMA_ARG_TOP_K: expects an integer"),
    ({"LLAMA_ARG_MODEL": "m" * (2 << 20)}, "longer than"),
])
def test_hostile_variables_give_one_clear_error(environ, message):
    with pytest.raises(LlamaServerArgsError, match=message):
        translate([], environ, NO_DORMOUSE_FLAGS)


def test_spec_type_is_read_against_the_draft_model_whatever_the_order():
    # draft-simple: llama-server's p-min, 0, unless the line gives one
    for argv in (["--spec-type", "draft-simple", "-md", "/m/d.gguf"], ["-md", "/m/d.gguf", "--spec-type", "draft-simple"]):
        assert translate(argv, {}, NO_DORMOUSE_FLAGS).settings == {"model_draft": "/m/d.gguf", "draft_p_min": 0.0}
        assert any("draft_p_min = 0" in note for note in translate(argv, {}, NO_DORMOUSE_FLAGS).notes)
    given = translate(["--spec-type", "draft-simple", "--spec-draft-p-min", "0.5"], {}, NO_DORMOUSE_FLAGS)
    assert given.settings == {"draft_p_min": 0.5}
    # what the line cannot reach is said: a config file's draft model is what drafts then
    assert any("without -md" in note for note in given.notes)
    # none: no draft model is loaded, named by llama-server's spelling or Dormouse's own
    for argv in (["--spec-type", "none", "-md", "/m/d.gguf"], ["-md", "/m/d.gguf", "--spec-type", "none"]):
        t = translate(argv, {}, NO_DORMOUSE_FLAGS)
        assert "model_draft" not in t.settings and any("is not loaded" in note for note in t.notes)
    for own in (["--model-draft", "/m/d.gguf"], ["--model-draft=/m/d.gguf"]):
        t = translate(["--spec-type", "none", *own, "--state-dir", "/s"], {})
        assert t.rest == ["--state-dir", "/s"] and any("(--model-draft) is not loaded" in note for note in t.notes)
    unset = translate([], {"LLAMA_ARG_SPEC_TYPE": "none"}, NO_DORMOUSE_FLAGS)
    assert unset.settings == {} and any("would still be loaded" in note for note in unset.notes)


def test_wrong_types_and_too_many_arguments_are_refused():
    for bad in ("-m x.gguf", ["-m", 5], [b"-m"]):
        with pytest.raises(LlamaServerArgsError, match="list of strings"):
            translate(bad, {}, NO_DORMOUSE_FLAGS)
    with pytest.raises(LlamaServerArgsError, match="more than"):
        translate(["--jinja"] * 5000, {}, NO_DORMOUSE_FLAGS)


def test_settings_refuse_a_value_llama_server_would_take_but_dormouse_cannot():
    t = translate(["--port", "70000", "--temp", "5"], {}, NO_DORMOUSE_FLAGS)
    with pytest.raises(Exception, match="port"):
        load_settings(None, t.serve_settings())


# -- llama_options: the names and types the worker accepts --

def test_the_llama_options_table_matches_llama_cpps_structures():
    from daemon.worker.llama_lib import llama

    ctypes_kind = {"c_int": "int", "c_int32": "int", "c_uint": "uint", "c_uint32": "uint", "c_float": "float",
                   "c_bool": "bool"}
    fields = {}
    for struct_name, struct in (("context", llama.llama_context_params), ("model", llama.llama_model_params)):
        for name, ctype in struct._fields_:
            fields[name] = (struct_name, ctypes_kind.get(ctype.__name__))
    for name, (struct_name, kind) in LLAMA_PARAM_FIELDS.items():
        assert fields[name] == (struct_name, kind), name
    assert set(WORKER_OWNED) <= set(fields)
    scalars = {name for name, (_, kind) in fields.items() if kind}
    assert scalars <= set(LLAMA_PARAM_FIELDS) | set(WORKER_OWNED), scalars - set(LLAMA_PARAM_FIELDS) - set(WORKER_OWNED)


@pytest.mark.parametrize("options, message", [
    ([("n_ubatch", 1)], "must be a table"),
    ({"kv_unified": True}, "the worker sets it"),
    ({"swa_full": False}, "the worker sets it"),
    ({"n_seq_max": 2}, "the worker sets it"),
    ({"tensor_split": 1}, "is not a llama.cpp context or model parameter"),
    ({"n_ubatch": True}, "must be an integer"),
    ({"n_ubatch": -1}, "from 0 to"),
    ({"n_ubatch": 2**40}, "from 0 to"),
    ({"main_gpu": 1.5}, "must be an integer"),
    ({"rope_freq_base": float("inf")}, "finite"),
    ({"rope_freq_base": "1e4"}, "finite"),
    ({"rope_freq_base": 1e300}, "finite"),
    ({"offload_kqv": 1}, "true or false"),
    ({1: 2}, "not a parameter name"),
    ({f"x{i}": 1 for i in range(100)}, "at most"),
])
def test_check_llama_options_refuses_hostile_tables(options, message):
    with pytest.raises(ValueError, match=message):
        check_llama_options(options)


def test_llama_options_from_the_environment_are_checked_at_startup(monkeypatch):
    monkeypatch.setenv("DORMOUSE_LLAMA_OPTIONS", '{"flash_attn_type": 1, "rope_freq_base": 5e5}')
    assert load_settings(None, {}).llama_options == {"flash_attn_type": 1, "rope_freq_base": 5e5}
    monkeypatch.setenv("DORMOUSE_LLAMA_OPTIONS", '{"kv_unified": true}')
    with pytest.raises(Exception, match="kv_unified: the worker sets it"):
        load_settings(None, {})


# -- the printed command line and the docs --

def test_main_prints_a_dormouse_command_line_with_the_same_meaning(capsys, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith(("DORMOUSE_", "LLAMA_ARG_"))]:
        monkeypatch.delenv(name)
    argv = ["-m", "/models/m.gguf", "-c", "2048", "-ngl", "all", "-fa", "on", "-a", "chat,gpt-4o", "--no-warmup",
            "--cors-origins", "https://ui.example", "--admin-key", "adm1n", "--repack"]
    assert lsa.main(argv) == 0
    words = shlex.split(capsys.readouterr().out)
    environment = dict(word.split("=", 1) for word in words if "=" in word and word.startswith("DORMOUSE_"))
    command = [word for word in words if not (word.startswith("DORMOUSE_") and "=" in word)]
    assert command[:2] == ["dormouse", "serve"] and "--admin-key" in command
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    from daemon.cli import _parser

    args = vars(_parser().parse_args(command[1:]))
    args.pop("command")
    settings = load_settings(None, args)
    expected = load_settings(None, {**translate(argv, {}).serve_settings(), "admin_key": "adm1n"})
    assert settings.public_dict() == expected.public_dict()
    assert settings.llama_options == {"flash_attn_type": 1} and settings.cpu_repack is True


def test_main_says_why_it_refuses(capsys):
    assert lsa.main(["--lora", "x.gguf"]) == 2
    assert "--lora is not supported: LoRA adapters" in capsys.readouterr().err


def test_the_committed_docs_table_is_the_generated_one():
    committed = (ROOT / "docs/llama-server-options.md").read_text()
    regenerate = "run: python -m daemon.llama_server_args --docs > docs/llama-server-options.md"
    assert committed == lsa.docs_table(), regenerate
    for option in OPTIONS:
        assert f"`{option.spellings[0]}`" in committed


@pytest.mark.parametrize("argv, environ, load_mode", [
    (["--mlock"], {}, "mmap+mlock"),
    (["--no-mmap"], {}, "none"),
    (["--no-mmap", "--mlock"], {}, "mlock"),
    (["--mlock", "--no-mmap"], {}, "mlock"),
    (["--mmap"], {}, "mmap"),
    ([], {"LLAMA_ARG_NO_MMAP": "1", "LLAMA_ARG_MLOCK": "true"}, "mlock"),
    ([], {"LLAMA_ARG_MLOCK": "0"}, None),
])
def test_older_llama_server_spellings_of_the_load_mode(argv, environ, load_mode):
    assert translate(argv, environ, NO_DORMOUSE_FLAGS).settings.get("load_mode") == load_mode


# Command lines of the kinds people keep in scripts, systemd units and llama-swap's `cmd:` entries
# (llama-swap puts its ${PORT} in --port): each must translate whole, with these settings.
@pytest.mark.parametrize("line, settings, llama_options", [
    ("--port 5800 -m /models/qwen2.5-1.5b-instruct-q4_k_m.gguf",
     {"port": 5800, "model": "/models/qwen2.5-1.5b-instruct-q4_k_m.gguf"}, {}),
    ("-hf ggml-org/Qwen2.5-Coder-3B-Q8_0-GGUF --port 8012 -ngl 99 -fa -ub 1024 -b 1024 -dt 0.1 --cache-reuse 256",
     {"hf_repo": "ggml-org/Qwen2.5-Coder-3B-Q8_0-GGUF", "port": 8012, "n_gpu_layers": 99, "batch_size": 1024},
     {"flash_attn_type": 1, "n_ubatch": 1024, "defrag_thold": 0.1}),
    ("--host 0.0.0.0 --port 8080 -ngl -1 -c 2048 -n 512 -m /data/m.gguf --admin-key adm1n",
     {"host": "0.0.0.0", "port": 8080, "n_gpu_layers": -1, "ctx_size": 2048, "n_predict": 512,
      "model": "/data/m.gguf"}, {}),
    ("-m /m/coder.gguf --alias coder -ngl 29 -c 4096 -t 8 --host 127.0.0.1 --port 9001 --jinja "
     "--chat-template-file /m/agent.jinja --no-mmap --mlock",
     {"model": "/m/coder.gguf", "models": {"coder": {"aliases": []}}, "n_gpu_layers": 29, "ctx_size": 4096,
      "threads": 8, "host": "127.0.0.1", "port": 9001, "chat_template_file": "/m/agent.jinja", "load_mode": "mlock"},
     {}),
    # -ub with embeddings: the batch is the micro-batch, as llama-server makes it (a pooled input sits in one)
    ("--port 9002 -m /m/e.gguf --embeddings --pooling mean -ub 8192 -b 8192 -np 2",
     {"port": 9002, "model": "/m/e.gguf", "embeddings": True, "pooling": "mean", "batch_size": 8192, "parallel": 2},
     {}),
    # llama.cpp's test suite: per-token vectors (pooling none)
    ("-m /m/e.gguf --embeddings --pooling none", {"model": "/m/e.gguf", "embeddings": True, "pooling": "none"}, {}),
    # a model's recommended sampling (Qwen3's), as llama-swap's examples carry it: the server-wide defaults
    ("--port 9003 -m /m/q.gguf -c 32768 -np 1 -fa on -ctk q8_0 -ctv q8_0 --temp 0.6 --top-k 20 --top-p 0.95 "
     "--min-p 0 --repeat-penalty 1.05 --repeat-last-n 128 --presence-penalty 1.5 --frequency-penalty 0.1",
     {"port": 9003, "model": "/m/q.gguf", "ctx_size": 32768, "parallel": 1, "temperature": 0.6, "top_k": 20,
      "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.05, "repeat_last_n": 128, "presence_penalty": 1.5,
      "frequency_penalty": 0.1},
     {"flash_attn_type": 1, "type_k": 8, "type_v": 8}),
])
def test_command_lines_from_scripts_translate_whole(line, settings, llama_options):
    argv = shlex.split(line)
    if settings is None:
        with pytest.raises(LlamaServerArgsError):
            translate(argv, {})
        return
    t = translate(argv, {})
    assert effect(t) == {**settings, **{f"llama_options.{k}": v for k, v in llama_options.items()}}
    assert all(word in ("--admin-key", "adm1n") for word in t.rest)


@pytest.mark.parametrize("argv, flash", [(["-fa"], 1), (["-fa", "-c", "512"], 1), (["-fa", "-1"], -1),
                                         (["--flash-attn", "off"], 0), (["-fa", "--admin-key", "k"], 1)])
def test_flash_attention_takes_its_value_or_stands_alone_as_it_once_did(argv, flash):
    assert translate(argv, {}).llama_options["flash_attn_type"] == flash


@pytest.mark.parametrize("argv, said", [
    (["-c", "8192"], True), (["-c", "8192", "-np", "-1"], True), (["-c", "0", "-m", "{model}"], True),
    (["-c", "8192", "-np", "2"], False), (["-c", "8192", "-kvu"], False), (["-c", "8192", "-no-kvu"], False),
    (["-np", "2"], False), ([], False),
])
def test_a_context_with_no_number_of_slots_says_how_llama_server_would_share_it(bundled_model, argv, said):
    # llama-server's -np auto turns -kvu on; Dormouse does not copy it from the spelling, it says so
    argv = [arg.replace("{model}", bundled_model) for arg in argv]
    notes = lsa.translate(argv, {}, own_flags=NO_DORMOUSE_FLAGS).notes
    assert any("add -kvu to share it as llama-server does" in note for note in notes) == said
