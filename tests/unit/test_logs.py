"""Log lines: JSON is whole JSON (jq, Docker, Fluent Bit, Vector read each line); the
journald priority prefix "<N>" goes only on lines written to journald's own stream, which
strips it before storing (so the journal holds whole JSON at the right priority)."""

import io
import json
import os

from daemon.logs import configure_logging, get_logger, writes_to_journald


def _journal_stream_of(f) -> str:
    info = os.fstat(f.fileno())
    return f"{info.st_dev}:{info.st_ino}"


def test_json_lines_to_journald_carry_the_priority_and_parse_after_it(tmp_path, monkeypatch):
    with open(tmp_path / "log", "w+") as stream:
        monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(stream))  # as if journald owned the stream
        configure_logging("json", "debug", stream=stream)
        log = get_logger()
        log.info("state", before="loading", after="ready")
        log.warning("state_dir.read_only", error="x")
        log.error("load.failed", reason="y")
        log.debug("d")
        stream.flush()
        lines = (tmp_path / "log").read_text().splitlines()
    # journald takes "<N>" as the entry's priority and stores what follows: whole JSON
    assert [line[:4] for line in lines] == ["<6>{", "<4>{", "<3>{", "<7>{"]
    events = [json.loads(line[3:]) for line in lines]
    assert [(e["event"], e["level"]) for e in events] == [("state", "info"), ("state_dir.read_only", "warning"),
                                                          ("load.failed", "error"), ("d", "debug")]


def test_json_lines_elsewhere_are_pure_json(tmp_path, monkeypatch):
    with open(tmp_path / "log", "w+") as stream, open(tmp_path / "journal", "w") as journal:
        monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(journal))  # journald owns another stream
        configure_logging("json", "info", stream=stream)
        get_logger().warning("state_dir.read_only", error="x")
        stream.flush()
        (line,) = (tmp_path / "log").read_text().splitlines()
    assert line.startswith("{") and json.loads(line)["level"] == "warning"


def test_auto_is_json_on_a_pipe_or_file_without_a_prefix(tmp_path, monkeypatch):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    with open(tmp_path / "log", "w+") as stream:
        configure_logging("auto", "info", stream=stream)
        get_logger().info("hello", n=1)
        stream.flush()
    (line,) = (tmp_path / "log").read_text().splitlines()
    assert json.loads(line)["event"] == "hello"


def test_console_lines_to_journald_carry_the_priority(tmp_path, monkeypatch):
    with open(tmp_path / "log", "w+") as stream:
        monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(stream))
        configure_logging("auto", "info", stream=stream)  # auto under journald: readable lines
        get_logger().info("wake.done", seconds=1.5)
        get_logger().warning("reload.needs_restart", keys=["ctx_size"])
        stream.flush()
    info, warning = (tmp_path / "log").read_text().splitlines()
    assert info.startswith("<6>") and "wake.done" in info and not info[3:].lstrip().startswith("{")
    assert warning.startswith("<4>") and "reload.needs_restart" in warning
    assert "\x1b[" not in info + warning  # no terminal colours in the journal


def test_journal_stream_must_name_this_very_stream(tmp_path, monkeypatch):
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        monkeypatch.setenv("JOURNAL_STREAM", _journal_stream_of(a))
        assert writes_to_journald(a) and not writes_to_journald(b)  # stderr redirected elsewhere: no prefix
    for hostile in ("", "garbage", "1:", ":2", "9" * 400 + ":1", "1:2:3"):
        monkeypatch.setenv("JOURNAL_STREAM", hostile)
        assert not writes_to_journald(io.StringIO())
        with open(tmp_path / "a", "w") as a:
            assert not writes_to_journald(a)
