"""llama-server's built-in tools (daemon/host_tools/builtin.py) on this host and through an isolate's commands."""

from __future__ import annotations

import base64
import fnmatch
import os
import random
import re
import subprocess

import pytest

from daemon.host_tools import builtin
from daemon.host_tools.builtin import RUN, ToolInputError, path_matches
from daemon.host_tools.runtime import HostIO, IsolateIO, RuntimeSpecError, check_runtime, run_process, tool_io


def call(name: str, params: dict, io: HostIO | None = None, emit=None) -> dict:
    return RUN[name](params, io or HostIO(), emit)


def local_isolate(cwd: str = "") -> IsolateIO:
    """An isolate whose "engine" runs the command here: every file operation goes through the POSIX commands
    a container or ssh host runs (test, wc, head, cat, find, sh)."""
    return IsolateIO(lambda inner, needs_stdin: list(inner), cwd)


def make_tree(root, rng: random.Random) -> None:
    for index in range(rng.randint(3, 12)):
        depth = rng.randint(0, 3)
        parts = [rng.choice(["src", "docs", "a", "b", "build", "node_modules", "deep"]) for _ in range(depth)]
        directory = root.joinpath(*parts)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"f{index}{rng.choice(['.py', '.txt', '.md', ''])}"
        directory.joinpath(name).write_text("".join(f"line {n} {rng.choice(['x', 'needle', 'y'])}\n"
                                                    for n in range(rng.randint(0, 6))))


# -- read, write, edit --

def test_read_file_reads_a_line_range_with_numbers_and_refuses_a_large_file_without_one(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("one\ntwo\nthree\n")
    assert call("read_file", {"path": str(path)}) == {"plain_text_response": "one\ntwo\nthree\n"}
    assert call("read_file", {"path": str(path), "start_line": 2, "end_line": 2, "append_loc": True}) == \
        {"plain_text_response": "2\u2192two\n"}
    big = tmp_path / "big.txt"
    big.write_text("x" * 100 + "\n" + "y" * 20000 + "\n")
    assert "file too large" in call("read_file", {"path": str(big)})["error"]
    cut = call("read_file", {"path": str(big), "start_line": 1, "end_line": 2})["plain_text_response"]
    assert cut == "x" * 100 + "\n[output truncated]"
    assert call("read_file", {"path": str(tmp_path / "none")}) == {"error": f"cannot stat file: {tmp_path / 'none'}"}


def test_read_file_as_base64_is_the_header_s_choice_and_byte_exact(tmp_path):
    data = bytes(range(256)) * 100
    (tmp_path / "bin").write_bytes(data)
    answer = call("read_file", {"path": "bin", "resp_type": "base64"}, HostIO(str(tmp_path)))
    assert base64.b64decode(answer["base64"]) == data and answer["size_bytes"] == len(data)


def test_a_binary_file_read_through_an_isolate_is_byte_exact(tmp_path):
    """The isolate reads a file with `head -c`: its bytes, not its output decoded as text (every byte value)."""
    data = bytes(range(256)) * 100
    (tmp_path / "bin").write_bytes(data)
    params = {"path": "bin", "resp_type": "base64"}
    assert call("read_file", params, local_isolate(str(tmp_path))) == call("read_file", params, HostIO(str(tmp_path)))
    assert base64.b64decode(call("read_file", params, local_isolate(str(tmp_path)))["base64"]) == data


def test_write_then_edit_applies_every_edit_against_the_original(tmp_path):
    io = HostIO(str(tmp_path))
    assert call("write_file", {"path": "sub/log", "content": "line1\nline2\nline3\n"}, io)["result"] == \
        "file written successfully"
    answer = call("edit_file", {"path": "sub/log", "edits": [{"old_text": "line2", "new_text": "line2-edited"},
                                                             {"old_text": "line3\n", "new_text": "line3\nline4\n"}]}, io)
    assert answer == {"result": "file edited successfully", "path": "sub/log", "edits_applied": 2}
    assert (tmp_path / "sub" / "log").read_text() == "line1\nline2-edited\nline3\nline4\n"


@pytest.mark.parametrize("content, edits, words", [
    ("dup\ndup\n", [{"old_text": "dup", "new_text": "x"}], "unique"),
    ("line1\nline2\n", [{"old_text": "line1\nline2", "new_text": "a"}, {"old_text": "line2", "new_text": "b"}], "overlap"),
    ("abc\n", [{"old_text": "zzz", "new_text": "a"}], "could not find edits[0]"),
    ("abc\n", [{"old_text": "abc", "new_text": "abc"}], "no changes made"),
    ("abc\n", [{"old_text": "", "new_text": "a"}], "must not be empty"),
    ("abc\n", [], "non-empty array"),
])
def test_edit_file_refuses_what_would_be_ambiguous_and_leaves_the_file_alone(tmp_path, content, edits, words):
    (tmp_path / "f").write_text(content)
    assert words in call("edit_file", {"path": str(tmp_path / "f"), "edits": edits})["error"]
    assert (tmp_path / "f").read_text() == content


def test_a_fuzzy_edit_changes_only_its_lines_and_keeps_the_others_byte_for_byte(tmp_path):
    """A model retypes typographic quotes and drops trailing blanks: the edit still lands, and every line it
    does not touch keeps its original bytes. Random files, random target line."""
    rng = random.Random(7)
    fancy = ["\u201cquoted\u201d", "it\u2019s", "a\u2014dash", "tab\t", "space  ", "plain", "nb\u00a0sp"]
    for trial in range(40):
        lines = [f"{rng.choice(fancy)} {n} {rng.choice(fancy)}" for n in range(rng.randint(2, 8))]
        path = tmp_path / f"f{trial}"
        path.write_text("\n".join(lines) + "\n")
        target = rng.randrange(len(lines))
        typed = builtin._fuzzy(lines[target])  # what the model sends: the ASCII form
        if typed == lines[target] or builtin._fuzzy("\n".join(lines)).count(typed) != 1:
            continue
        answer = call("edit_file", {"path": str(path), "edits": [{"old_text": typed, "new_text": "NEW"}]})
        assert answer.get("edits_applied") == 1, answer
        after = path.read_text().split("\n")
        # an exact match (the line's start) keeps what follows it; a fuzzy one replaces the normalised line
        assert after[target] == ("NEW" + lines[target][len(typed):] if lines[target].startswith(typed) else "NEW")
        assert [line for n, line in enumerate(after[:-1]) if n != target] == \
            [line for n, line in enumerate(lines) if n != target]


# -- listings and search --

def test_glob_search_lists_dirs_depths_and_limits_as_llama_server(tmp_path):
    (tmp_path / "project-alpha" / "src").mkdir(parents=True)
    (tmp_path / "project-alpha" / "README.md").write_text("alpha")
    (tmp_path / "project-beta").mkdir()
    (tmp_path / "top.txt").write_text("top")
    (tmp_path / "build" / "nested").mkdir(parents=True)
    (tmp_path / "build" / "artifact.txt").write_text("built")
    dirs = call("file_glob_search", {"path": str(tmp_path), "type": "dir"})
    kinds = {e["path"]: e["type"] for e in dirs["entries"]}
    assert kinds == {"project-alpha": "dir", "project-alpha/src": "dir", "project-beta": "dir", "build": "dir"}
    assert "project-alpha/" in dirs["plain_text_response"] and dirs["base"] == str(tmp_path)
    files = [e["path"] for e in call("file_glob_search", {"path": str(tmp_path), "type": "all"})["entries"]]
    assert "top.txt" in files and "build/artifact.txt" not in files and "build/nested" not in files
    assert [e["path"] for e in call("file_glob_search", {"path": str(tmp_path), "max_depth": 1})["entries"]] == \
        ["top.txt"]
    limited = call("file_glob_search", {"path": str(tmp_path), "limit": 1, "type": "all"})
    assert len(limited["entries"]) == 1 and "Total matches: 6" in limited["plain_text_response"]
    assert "invalid type" in call("file_glob_search", {"path": str(tmp_path), "type": "bogus"})["error"]
    assert "invalid limit" in call("file_glob_search", {"path": str(tmp_path), "limit": 0})["error"]
    assert "not a directory" in call("file_glob_search", {"path": str(tmp_path / "top.txt")})["error"]


def test_glob_search_in_a_git_repository_leaves_out_what_gitignore_ignores(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("*.log\n")
    (tmp_path / "keep.py").write_text("x")
    (tmp_path / "drop.log").write_text("x")
    paths = [e["path"] for e in call("file_glob_search", {"path": str(tmp_path)})["entries"]]
    assert "keep.py" in paths and "drop.log" not in paths


def test_grep_search_finds_lines_with_context_and_numbers_and_stops_at_its_limit(tmp_path):
    (tmp_path / "a.py").write_text("zero\nneedle one\ntwo\n")
    (tmp_path / "b.txt").write_text("NEEDLE\n")
    text = call("grep_search", {"path": str(tmp_path), "pattern": "needle", "include": "*.py",
                                "context_lines": 1})["plain_text_response"]
    assert text.startswith("a.py-1-zero\na.py:2:needle one\na.py-3-two\n--\n") and "Total matches: 1" in text
    text = call("grep_search", {"path": str(tmp_path), "pattern": "needle", "ignore_case": True})["plain_text_response"]
    assert "Total matches: 2" in text
    assert "Total matches: 0" in call("grep_search", {"path": str(tmp_path), "pattern": "needle.",
                                                      "literal": True})["plain_text_response"]
    assert "invalid regex" in call("grep_search", {"path": str(tmp_path), "pattern": "("})["error"]
    (tmp_path / "many.txt").write_text("hit\n" * 500)
    text = call("grep_search", {"path": str(tmp_path / "many.txt"), "pattern": "hit"})["plain_text_response"]
    assert "Total matches: 100" in text and "limit reached" in text


def test_a_pattern_without_a_slash_matches_the_basename_as_fnmatch_does():
    """Random patterns of letters, '*', '?' and classes against random paths: the basename rule, checked
    against the standard library's fnmatch (a basename holds no '/', where the two agree)."""
    rng = random.Random(3)
    for _ in range(2000):
        pattern = "".join(rng.choice(["a", "b", ".", "*", "?", "[ab]", "[!a]"]) for _ in range(rng.randint(1, 5)))
        name = "".join(rng.choice("ab.") for _ in range(rng.randint(0, 5)))
        rel = "/".join(["dir"] * rng.randint(0, 2) + [name])
        assert path_matches(pattern, rel) == fnmatch.fnmatchcase(name, pattern), (pattern, rel)


def test_slash_patterns_anchor_as_llama_server_documents():
    assert path_matches("src/*.cpp", "src/main.cpp") and path_matches("src/*.cpp", "x/src/main.cpp")
    assert not path_matches("src/*.cpp", "src/deep/main.cpp")
    assert path_matches("src/**/*.cpp", "src/deep/er/main.cpp") and path_matches("src/**/*.cpp", "src/main.cpp")
    assert path_matches("/src/*.cpp", "src/main.cpp") and not path_matches("/src/*.cpp", "x/src/main.cpp")


# -- commands --

def test_a_command_s_output_exit_code_and_timeout_are_reported(tmp_path):
    assert call("exec_shell_command", {"command": "echo hi; exit 3"}) == {"plain_text_response": "hi\n\n[exit code: 3]"}
    answer = call("exec_shell_command", {"command": "echo start; sleep 30", "timeout": 1})
    assert answer["plain_text_response"].startswith("start\n") and "[exit due to timed out]" in \
        answer["plain_text_response"]
    answer = call("exec_shell_command", {"command": "head -c 100000 /dev/zero | tr '\\0' x", "max_output_size": 10})
    assert answer["plain_text_response"].startswith("xxxxxxxxxx\n[output truncated]")
    answer = call("exec_shell_command", {"command": "pwd"}, HostIO(str(tmp_path)))
    assert answer["plain_text_response"].startswith(str(tmp_path))


def test_a_streamed_command_sends_its_output_as_it_comes_then_the_exit_code():
    chunks: list[str] = []
    assert call("exec_shell_command", {"command": "echo one; echo two"}, emit=chunks.append) == {}
    assert "".join(chunks) == "one\ntwo\n\n[exit code: 0]"


def test_a_timed_out_command_s_children_die_with_it(tmp_path):
    """The whole process group is killed: a background child of the command does not outlive the timeout."""
    marker = tmp_path / "pid"
    run_process(["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"], 100, 1)
    pid = int(marker.read_text())
    for _ in range(100):  # bounded by count: the kill is asynchronous
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        subprocess.run(["sleep", "0.05"])
    else:
        pytest.fail("the command's background child is still alive")


@pytest.mark.parametrize("name, params, words", [
    ("read_file", {"path": 5}, "params.path must be str"),
    ("read_file", {}, "params.path is required"),
    ("read_file", {"path": "x", "start_line": True}, "params.start_line must be an integer"),
    ("read_file", {"path": "x", "start_line": "2"}, "params.start_line must be an integer"),
    ("exec_shell_command", {"command": ["ls"]}, "params.command must be str"),
    ("edit_file", {"path": "x", "edits": [5]}, "params.edits[0] must be an object"),
    ("edit_file", {"path": "x", "edits": {"old_text": "a"}}, "params.edits must be list"),
    ("write_file", {"path": "a\x00b", "content": ""}, "NUL"),
    ("file_glob_search", {"path": ".", "include": "*" * 2000}, "longer than 1024"),
])
def test_parameters_of_the_wrong_type_are_refused_by_name(name, params, words):
    with pytest.raises(ToolInputError, match=re.escape(words)):
        call(name, params)


# -- runtimes --

@pytest.mark.parametrize("spec, words", [
    ("fake:does-not-exist", "unknown tool runtime"),
    ("ssh:-oProxyCommand=touch /tmp/pwned", "invalid ssh target"),
    ("ssh:", "invalid ssh target"),
    ("docker-container:--privileged", "invalid container id"),
    ("podman-container:a b", "invalid container id"),
    ("docker:busybox", "must name a running container"),
])
def test_a_runtime_a_client_names_is_checked_before_anything_runs(spec, words):
    with pytest.raises(RuntimeSpecError, match=words):
        check_runtime(spec)
    with pytest.raises(RuntimeSpecError, match=words):
        tool_io(spec, "")


def test_the_daemon_s_own_runtime_may_start_a_container_from_an_image():
    check_runtime("docker:busybox", startable=True)
    with pytest.raises(RuntimeSpecError, match="image"):
        check_runtime("docker:-x", startable=True)


def test_an_isolate_answers_as_this_host_does_for_random_trees(tmp_path):
    """The isolate does each file operation with a POSIX command (what it runs in a container or over ssh):
    for random trees its listings, reads, searches and writes equal the host's."""
    for seed in range(6):
        rng = random.Random(seed)
        root = tmp_path / f"t{seed}"
        root.mkdir()
        make_tree(root, rng)
        host, isolate = HostIO(str(root)), local_isolate(str(root))
        for kind in ("file", "dir", "all"):
            for depth in (0, 1, 2):
                params = {"path": ".", "type": kind, "max_depth": depth}
                got, want = call("file_glob_search", params, isolate), call("file_glob_search", params, host)
                assert sorted(map(str, got["entries"])) == sorted(map(str, want["entries"])), (seed, kind, depth)
        for entry in call("file_glob_search", {"path": "."}, host)["entries"]:
            assert call("read_file", {"path": entry["path"]}, isolate) == call("read_file", {"path": entry["path"]}, host)
        grep = {"path": ".", "pattern": "needle", "return_line_numbers": True}
        assert sorted(call("grep_search", grep, isolate)["plain_text_response"].splitlines()) == \
            sorted(call("grep_search", grep, host)["plain_text_response"].splitlines())
        assert call("write_file", {"path": "new/dir/f", "content": "é\n"}, isolate)["bytes"] == 3
        assert (root / "new" / "dir" / "f").read_text() == "é\n"
        assert call("exec_shell_command", {"command": "pwd"}, isolate)["plain_text_response"].startswith(str(root))
