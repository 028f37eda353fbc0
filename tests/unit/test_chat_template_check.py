"""A model with no chat template is named once at start, with what to do (issue 30: the
bundled base model's chat reads as nonsense and nothing said why)."""

import asyncio

from config import Settings
from daemon.fleet.plans import ModelPlan
from daemon.model.chat_template_check import has_chat_template, untemplated, warn_untemplated
from tests.fixtures.tiny_model import write_tiny_model


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.events.append((event, fields))


def plan(id: str, path: str, **settings) -> ModelPlan:
    return ModelPlan(id=id, settings=Settings(model=path, **settings), model_path=path)


def test_the_bundled_base_model_has_none_and_a_chat_model_has_one(tmp_path, bundled_model):
    assert has_chat_template(bundled_model) is False
    assert has_chat_template(str(write_tiny_model(tmp_path / "tiny.gguf"))) is True


def test_an_unreadable_file_is_not_called_templateless(tmp_path):
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF\x03\x00")
    assert has_chat_template(str(truncated)) is None  # check-config names that problem, not this one
    assert has_chat_template(str(tmp_path / "missing.gguf")) is None


def test_the_warning_names_the_base_model_only_and_says_what_to_serve(tmp_path, bundled_model):
    chat = str(write_tiny_model(tmp_path / "tiny.gguf"))
    plans = [plan("base", bundled_model), plan("chat", chat),
             plan("templated", bundled_model, chat_template="chatml"),  # a configured template: fine
             plan("embedder", bundled_model, embeddings=True)]  # no chat at all: nothing to say
    assert [p.id for p in untemplated(plans)] == ["base"]
    log = Recorder()
    asyncio.run(warn_untemplated(plans, log))
    ((event, fields),) = log.events
    assert event == "model.no_chat_template" and fields["model"] == "base"
    assert "-hf" in fields["fix"] and "chat_template" in fields["fix"] and "completions" in fields["meaning"]
