"""The generated references (docs/reference/) are what the code generates: a key or a metric
added, renamed or redescribed without `--write` fails here, so the docs cannot drift."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry

from config.models import ModelSettings
from config.reloadable import RELOADABLE
from config.settings import Settings
from daemon import config_reference, metrics_reference
from daemon.fleet.metrics import FleetMetrics
from daemon.metrics import MetricFamilies, Metrics


@pytest.mark.parametrize("module", [config_reference, metrics_reference], ids=["configuration", "metrics"])
def test_the_committed_page_is_what_the_code_generates(module):
    committed = module.PAGE.read_text()
    assert committed == module.render(), f"{module.PAGE.name} is stale: run `{module.REGENERATE}`"


def _settings_rows() -> dict[str, list[str]]:
    page = config_reference.render()
    section = page.split("## Settings")[1].split("## `[models.ID]` tables")[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `([a-z_]+)` \|", line)
        if match:
            rows[match.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def test_every_setting_and_every_model_key_has_a_row():
    rows = _settings_rows()
    assert set(rows) == set(Settings.model_fields)
    model_section = config_reference.render().split("## `[models.ID]` tables")[1]
    assert set(re.findall(r"^\| `([a-z_]+)` \|", model_section, re.M)) == set(ModelSettings.model_fields)


def test_a_row_says_the_flag_the_variable_the_default_and_the_reload():
    rows = _settings_rows()
    key, kind, default, flag, llama, env, reload, _ = rows["ctx_size"]
    assert (kind, default, flag, env, reload) == ("integer", "`4096`", "`--ctx-size`", "`DORMOUSE_CTX_SIZE`", "restart")
    assert "`-c`" in llama and "`LLAMA_ARG_CTX_SIZE`" in llama
    assert rows["temperature"][3] == "`--temp`"  # the flag's dest differs from its name
    assert rows["spawn_ahead"][3] == "`--spawn-ahead`, `--no-spawn-ahead`"
    assert "`-hf`" in rows["hf_repo"][4]
    assert rows["kv_cache_disk_bytes"][2] == "`4294967296` (4 GiB)"
    # a figure computed from this machine is not written down, or the page would differ per host
    assert rows["prompt_cache_ram_bytes"][2] == "computed at start"
    assert {k for k, row in rows.items() if row[6] == "applied"} == set(RELOADABLE)


def test_a_table_cell_cannot_break_the_table():
    assert config_reference.cell("a|b\n  c") == "a\\|b c"
    for line in config_reference.render().splitlines():
        if line.startswith("| `"):
            assert len(re.split(r"(?<!\\)\|", line)) in (7, 10), line  # 5 or 8 cells


def test_every_registered_family_is_listed_with_its_labels():
    registry = CollectorRegistry()
    families = MetricFamilies(registry)
    FleetMetrics(registry)
    Metrics(families, "chat")
    page = metrics_reference.render()
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{name}` | {family.type} |" in page, name
    listed = {f.name: f for f in metrics_reference.own_families()}
    assert listed["dormouse_resume_phase_seconds"].labels == ("model", "reason", "phase")
    assert listed["dormouse_fleet_loads_in_progress"].labels == ()
    # the per-request detail kept outside the registry is not on /metrics, so not listed as Dormouse's own
    assert "dormouse_request_inference_seconds" not in listed


def test_each_compat_kind_lists_only_its_own_names():
    compat = metrics_reference.compat_families()
    for kind, prefix in metrics_reference.COMPAT_KINDS.items():
        assert compat[kind], kind
        assert all(f.name.startswith(prefix) for f in compat[kind]), kind
    vllm = {f.name: f for f in compat["vllm"]}
    assert set(vllm["vllm:num_requests_waiting"].labels) == {"model_name", "engine"}


@pytest.mark.parametrize("module", [config_reference, metrics_reference], ids=["configuration", "metrics"])
def test_write_makes_a_stale_page_current(module, tmp_path, monkeypatch, capsys):
    page = tmp_path / "reference" / module.PAGE.name
    monkeypatch.setattr(module, "PAGE", page)
    assert module.main(["--write"]) == 0
    assert page.read_text() == module.render()
    page.write_text("stale")
    module.main(["--write"])
    assert page.read_text() == module.render()
    assert module.main([]) == 0 and capsys.readouterr().out.endswith(module.render())


@pytest.mark.parametrize("module", [config_reference, metrics_reference], ids=["configuration", "metrics"])
@pytest.mark.parametrize("argv", [["--wirte"], ["--write", "extra"], ["-" * 10_000]])
def test_a_mistyped_command_line_writes_nothing(module, argv, tmp_path, monkeypatch, capsys):
    page = tmp_path / module.PAGE.name
    monkeypatch.setattr(module, "PAGE", page)
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2 and not page.exists()
    assert "usage:" in capsys.readouterr().err
