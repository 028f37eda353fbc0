"""Issue 30's "done when": a newcomer follows README alone and serves a real
chat model by name, chats, sees it sleep and wake, and finds each setting in
the generated reference.

The commands are README's own, read from its code blocks at test time (so the
test fails when README drifts from what works): `dormouse pull` and `dormouse
serve --hf-repo` of the repository README names, the curl chat, the OpenAI
client snippet (run as written, its URL pointed at this test's port), and the
"Watch it sleep and wake" block line by line. What a test cannot do is
replaced, and only that:

- the hub is the local stand-in (tests/fixtures/fake_hub.py, via HF_ENDPOINT),
  serving under README's repository name the bundled Gemma 3 270M copied with
  a chat template written into it (the gguf package), so that it is a chat
  model as README's is;
- the port is a free one, and `dormouse status` finds it by $DORMOUSE_URL;
- `make serve`'s build is the test's own venv (`.venv/bin/` is this
  interpreter's bin directory), and serve gets a config file with threads = 2
  and n_predict = 32 so the chats end quickly on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, DaemonProcess, bundled_model_path
from tests.fixtures.fake_hub import FakeHub

pytestmark = pytest.mark.e2e

README = ROOT / "README.md"
BIN = Path(sys.executable).parent
README_PORT = re.compile(r"\b(?:localhost|127\.0\.0\.1):8080\b")


# -- README, read as a newcomer reads it --

def section(title: str) -> str:
    """The text of README's `## title` section."""
    text = README.read_text()
    start = text.find(f"\n## {title}\n")
    assert start >= 0, f"README has no section '## {title}'"
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def words(command: str) -> list[str]:
    """A command's words without its trailing comment."""
    return shlex.split(command, comments=True)


def local(command: str, port: int) -> str:
    """README's command for this machine: this venv's bin directory, this test's port."""
    return README_PORT.sub(f"127.0.0.1:{port}", command.replace(".venv/bin/", f"{BIN}/"))


def sh(command: str, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def run_snippet(code: str, port: int) -> str:
    """README's Python snippet as written, its base_url pointed here; what it printed."""
    assert README_PORT.search(code), "the snippet names no 127.0.0.1:8080 to point elsewhere"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(local(code, port), "README.md", "exec"), {"__name__": "readme_snippet"})  # noqa: S102
    return out.getvalue()


# -- the stand-in for README's chat model --

@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The bundled GGUF with Gemma's chat template in tokenizer.chat_template: a chat model by its file."""
    import gguf

    from daemon.worker.chat import GEMMA_TEMPLATE

    out = tmp_path_factory.mktemp("chat") / "chat.gguf"
    proc = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", bundled_model_path(), str(out),
                           "--chat-template", GEMMA_TEMPLATE, "--force"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    field = gguf.GGUFReader(out).get_field("tokenizer.chat_template")
    assert field is not None and field.contents() == GEMMA_TEMPLATE
    return out


def test_a_newcomer_follows_readme_from_a_model_by_name_to_sleep_and_wake(tmp_path, chat_model, monkeypatch):
    first_chat = section("A first chat, with a real chat model")
    start = commands(blocks(first_chat, "sh")[0])
    pull = next(c for c in start if words(c)[1:2] == ["pull"])
    serve = next(c for c in start if words(c)[1:2] == ["serve"])
    repo = words(pull)[2]
    assert words(serve)[2:] == ["--hf-repo", repo], serve  # serve takes what pull fetched
    owner_name, _, quant = repo.partition(":")
    quant = quant or "Q4_K_M"  # README: "Q4_K_M unless a :QUANT tag says otherwise"
    file_name = f"{owner_name.split('/')[1].removesuffix('-GGUF')}-{quant}.gguf"

    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "DORMOUSE_URL"):
        monkeypatch.delenv(name, raising=False)  # the daemon and the CLI inherit this environment
    state = tmp_path / "state"
    config = tmp_path / "dormouse.toml"
    config.write_text("threads = 2\nn_predict = 32\nsleep_idle_seconds = -1\n")
    with FakeHub() as hub:
        hub.add(owner_name, {"README.md": b"# a chat model", file_name: chat_model.read_bytes(),
                             file_name.replace(quant, "Q8_0"): b"not fetched"})
        env = {**os.environ, "HF_ENDPOINT": hub.url, "DORMOUSE_STATE_DIR": str(state)}

        # 1. dormouse pull <repo>: the file README's name picks, into state_dir/models.
        said = sh(local(pull, 0), env)
        pulled = Path(said.split("model: ", 1)[1].split("\n", 1)[0])
        assert pulled.name == file_name and pulled.is_relative_to(state / "models"), said
        assert hub.downloads() == [f"/{owner_name}/resolve/main/{file_name}"]

        # 2. dormouse serve --hf-repo <repo>: serves what pull fetched, asking the hub for nothing more.
        d = DaemonProcess(*words(serve)[2:], "--config", str(config),
                          env={"HF_ENDPOINT": hub.url, "DORMOUSE_STATE_DIR": str(state)},
                          log_path=tmp_path / "daemon.log")
        env["DORMOUSE_URL"] = d.url
        try:
            d.wait_state("ready", timeout=300)
            assert d.props()["id"] == file_name.removesuffix(".gguf")
            assert len(hub.downloads()) == 1

            # 3. The curl chat and the OpenAI client, as README writes them.
            curl_chat = commands(blocks(first_chat, "sh")[1])
            assert len(curl_chat) == 1 and "/v1/chat/completions" in curl_chat[0]
            answer = json.loads(sh(local(curl_chat[0], d.port), env))
            assert answer["choices"][0]["message"]["content"].strip(), answer
            snippet = blocks(first_chat, "python")[0]
            assert run_snippet(snippet, d.port).strip(), "the client's chat printed nothing"

            # 4. Watch it sleep and wake, line by line.
            watch = commands(blocks(section("Watch it sleep and wake"), "sh")[0])
            assert [words(c)[1] for c in watch if words(c)[0].endswith("dormouse")] == ["status", "status"]
            status_awake = sh(local(watch[0], d.port), env)
            assert re.search(r"^state\s+ready", status_awake, re.M), status_awake
            sleep_line = watch[1]
            assert "/sleep" in sleep_line
            sh(local(sleep_line, d.port), env)
            status_asleep = sh(local(watch[2], d.port), env)
            assert re.search(r"^state\s+sleeping", status_asleep, re.M), status_asleep
            assert re.search(r"^why\s+asked to \(POST /sleep\)", status_asleep, re.M), status_asleep
            assert d.props()["is_sleeping"] is True
            woke = sh(local(watch[3], d.port), env)  # a completion that waits for the wake
            assert re.search(r"^x-dormouse-cold-start: true", woke, re.I | re.M), woke
            assert d.props()["state"] == "ready" and d.props()["last_wake"]["reason"] == "request"

            # 5. Asleep again, the client's chat wakes it.
            sh(local(sleep_line, d.port), env)
            d.wait_state("sleeping")
            wakes_before = d.props()["last_wake"]["at"]
            assert run_snippet(snippet, d.port).strip()
            props = d.props()
            assert props["state"] == "ready" and props["last_wake"]["at"] > wakes_before
            assert props["last_wake"]["reason"] == "request"
            assert len(hub.downloads()) == 1  # every wake read the pulled file, none went to the hub
        finally:
            assert d.stop() == 0, d.log()[-3000:]


def test_every_setting_and_flag_readme_names_is_in_the_generated_reference():
    reference = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    rows = [line for line in reference.splitlines() if line.startswith("| `")]  # both tables: top level, [models.ID]
    listed = {row.split("|")[1].strip().strip("`") for row in rows}
    text = README.read_text()
    keys = set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", text))
    assert "sleep_idle_seconds" in keys  # the parse finds what README names
    missing = sorted(k for k in keys if k not in listed)
    assert not missing, f"README names settings the reference does not list: {missing}"
    # Every flag of a dormouse command (serve, or ARGS= for make serve), and its llama-server spellings.
    flags = set()
    for block in blocks(text, "sh"):
        for command in commands(block):
            ws = words(command)
            if any(w.endswith("dormouse") for w in ws[:1]) or any(w.startswith("ARGS=") for w in ws):
                flags |= {w for w in " ".join(ws).replace('"', " ").split() if re.fullmatch(r"--?[a-z][a-z-]*", w)}
    for span in re.findall(r"`([^`\n]+)`", text):  # inline: `-hf`, `make serve ARGS="--sleep-idle-seconds 60"`
        if re.fullmatch(r"--?[a-z][a-z-]*", span):
            flags.add(span)
        elif "ARGS=" in span or "dormouse serve" in span:
            flags |= set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", span))
    flags -= {"--json"}  # the CLI's own output switch, not a setting
    assert {"--hf-repo", "--sleep-idle-seconds", "-hf"} <= flags, flags
    missing = sorted(f for f in flags if not any(f"`{f}`" in row for row in rows))
    assert not missing, f"README names flags the reference does not list: {missing}"
