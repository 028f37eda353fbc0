"""Server-wide template variables: `chat_template_kwargs`, from llama-server's -rea off,
--reasoning-budget 0 and --chat-template-kwargs (issue 29), checked as strictly as a request's."""

from __future__ import annotations

import json

import pytest

from config.template_kwargs import MAX_BYTES, MAX_ENTRIES, check_template_kwargs
from daemon.llama_server_args import LlamaServerArgsError, translate

NO_DORMOUSE_FLAGS: dict[str, bool] = {}


def kwargs_of(argv, environ=None):
    return translate(argv, environ or {}, NO_DORMOUSE_FLAGS).settings.get("chat_template_kwargs")


@pytest.mark.parametrize("argv", [["-rea", "off"], ["--reasoning", "0"], ["--reasoning=false"],
                                  ["--reasoning-budget", "0"]])
def test_reasoning_off_turns_thinking_off_in_every_template(argv):
    assert kwargs_of(argv) == {"enable_thinking": False}


@pytest.mark.parametrize("argv", [["-rea", "on"], ["-rea", "auto"], ["--reasoning-budget", "-1"]])
def test_reasoning_on_or_auto_is_dormouses_default_and_changes_nothing(argv):
    t = translate(argv, {}, NO_DORMOUSE_FLAGS)
    assert "chat_template_kwargs" not in t.settings and t.notes


def test_the_variable_reads_as_the_option():
    assert kwargs_of([], {"LLAMA_ARG_REASONING": "off"}) == {"enable_thinking": False}
    assert kwargs_of([], {"LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"tone": "dry"}'}) == {"tone": "dry"}


def test_kwargs_and_reasoning_merge_and_the_last_given_wins():
    argv = ["--chat-template-kwargs", '{"enable_thinking": true, "tone": "dry"}', "-rea", "off"]
    assert kwargs_of(argv) == {"enable_thinking": False, "tone": "dry"}
    argv = ["-rea", "off", "--chat-template-kwargs", '{"enable_thinking": true}']
    assert kwargs_of(argv) == {"enable_thinking": True}
    argv = ["--chat-template-kwargs", '{"enable_thinking": false, "tone": "dry"}', "-rea", "on"]
    assert kwargs_of(argv) == {"tone": "dry"}  # on, given last, undoes the earlier false
    assert not kwargs_of(["-rea", "off", "-rea", "auto"])


@pytest.mark.parametrize("argv, message", [
    (["-rea", "sometimes"], "expects on, off or auto"),
    (["--reasoning-budget", "512"], "does not count thinking tokens"),
    (["--chat-template-kwargs", "not json"], "must be a JSON object"),
    (["--chat-template-kwargs", "[1, 2]"], "must be a table"),
    (["--chat-template-kwargs", '{"enable_thinking": "no"}'], "enable_thinking must be true or false"),
    (["--chat-template-kwargs", '{"messages": []}'], "not a template variable"),
    (["--chat-template-kwargs", '{"": 1}'], "not a template variable"),
    (["--chat-template-kwargs", json.dumps({f"k{i}": i for i in range(MAX_ENTRIES + 1)})], "at most"),
    (["--chat-template-kwargs", json.dumps({"big": "x" * MAX_BYTES})], "bytes of JSON"),
    (["--chat-template-kwargs", "[" * 5000 + "]" * 5000], "--chat-template-kwargs"),
])
def test_hostile_values_are_refused_naming_the_option(argv, message):
    with pytest.raises(LlamaServerArgsError) as refused:
        translate(argv, {}, NO_DORMOUSE_FLAGS)
    assert argv[0] in str(refused.value) and message in str(refused.value), str(refused.value)


def test_the_setting_is_checked_when_the_config_gives_it(tmp_path, monkeypatch):
    from config import Settings

    monkeypatch.setenv("DORMOUSE_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": false}')
    assert Settings().chat_template_kwargs == {"enable_thinking": False}
    monkeypatch.setenv("DORMOUSE_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": 0}')
    with pytest.raises(ValueError, match="enable_thinking"):
        Settings()


def test_a_table_is_returned_as_it_is():
    value = {"enable_thinking": False, "nested": {"a": [1, "x"]}}
    assert check_template_kwargs(value) == value
