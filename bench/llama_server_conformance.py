"""llama.cpp's own server tests (tools/server/tests) run against `dormouse serve` (issue 29).

    .venv/bin/python -m bench.llama_server_conformance --sdist /tmp/sdist/llama_cpp_python-0.3.36.tar.gz

The suite is the one in the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp/tools/server/tests, the
llama.cpp commit Dormouse's llama-cpp-python vendors). This script fetches nothing; get the sdist once:

    .venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sdist

`--sdist` takes the .tar.gz or the unpacked folder. The suite's utils.py starts its server as
$LLAMA_SERVER_BIN_PATH with llama-server's command line; that variable names a shim here which runs
`dormouse serve` with the same arguments (Dormouse's CLI takes llama-server's flags), changing only the
model references: --hf-repo/--hf-file/--model-url/--model/--model-draft all become the one local GGUF
(--model; default: the bundled Gemma 3 270M). Router mode (no model on the command line) is left as
it is. The suite's `download_file(url)` goes through a stand-in `wget` module that links a model URL
to the same GGUF and refuses the LoRA adapters (not models, and nothing is fetched). The session-start
`ServerPreset.load_all()` (it only warms the suite's download cache) is turned off.

Only the fast tests run (`-m "not slow"`; the tests the suite skips unless SLOW_TESTS=1 skip too).
`--server-bin PATH` runs the same suite, with the same model substitution, against a real
llama-server binary instead, for the figures beside Dormouse's. The output: pass/fail/skip/error per
test file and the total; `--json PATH` keeps each test's outcome, `--compare PATH` lists the tests
whose outcome differs from such an earlier file.

The suite's own requirements (its requirements.txt): pytest, requests, openai, prometheus-client,
numpy, filelock, aiohttp are in the `test` extra already; `wget` and `pytest-xdist` are not needed
(wget is stood in for; the run is serial). Takes about 18 minutes on 2 idle cores (2026-12-08), more on busy
ones (docs/llama-server.md): run it file by file (`-- unit/test_embedding.py`) to measure a change.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE_IN_SDIST = "vendor/llama.cpp/tools/server/tests"
TEMPLATES_IN_SDIST = "vendor/llama.cpp/models/templates"
GET_SDIST = ".venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sdist"

# Options whose value names a model: each becomes the one local GGUF. --hf-file only qualifies --hf-repo.
MODEL_OPTIONS = {"-m", "--model", "-hf", "-hfr", "--hf-repo", "-mu", "--model-url"}
DRAFT_OPTIONS = {"-md", "--model-draft", "-hfd", "-hfrd", "--hf-repo-draft"}
DROPPED_OPTIONS = {"-hff", "--hf-file", "-hffd", "--hf-file-draft"}
# download_file() URLs that are LoRA adapters, not models: refused, never fetched.
LORA_NAMES = {"moe_shakespeare15M.gguf", "Llama-3-Instruct-abliteration-LoRA-8B-f16.gguf"}

SHIM = '''#!{python}
"""llama-server's command line -> `dormouse serve` (or --server-bin), model references mapped."""
import os, sys
MODEL = {model!r}
MODEL_OPTIONS, DRAFT_OPTIONS, DROPPED = {model_options!r}, {draft_options!r}, {dropped!r}
out, named, i, args = [], False, 0, sys.argv[1:]
while i < len(args):
    arg = args[i]
    name, eq, value = arg.partition("=")
    takes = name in MODEL_OPTIONS or name in DRAFT_OPTIONS or name in DROPPED
    if takes and not eq:
        i += 1  # the value is the next argument
    if name in MODEL_OPTIONS:
        named = True
    elif name in DRAFT_OPTIONS:
        out += ["--model-draft", MODEL]
    elif not takes:
        out.append(arg)
    i += 1
if named:
    out += ["--model", MODEL]
command = {command!r} + out
sys.stderr.write("conformance shim: " + " ".join(command) + "\\n")
sys.stderr.flush()
os.execv(command[0], command)
'''

WGET = '''"""The suite's `wget` stand-in: a model URL becomes a link to the local GGUF; nothing is fetched."""
import os
MODEL, LORA_NAMES = {model!r}, {lora!r}

def download(url, out=None, bar=None):
    name = url.rsplit("/", 1)[-1]
    if name in LORA_NAMES or not name.endswith(".gguf"):
        raise RuntimeError(f"conformance run: {{url}} is not a model and is not fetched")
    out = out or name
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.symlink(MODEL, out)
    return out
'''

PLUGIN = '''"""Loaded with -p: ServerPreset.load_all() only warms the suite's download cache; nothing to warm."""
import sys

def pytest_collection_modifyitems(session, config, items):
    utils = sys.modules.get("utils")
    if utils is not None:
        utils.ServerPreset.load_all = staticmethod(lambda: None)
'''


def _suite(sdist: Path, work: Path) -> Path:
    """The tests folder, copied out of the sdist (tar or unpacked) into `work` with llama.cpp's layout kept:
    the suite writes tmp/ beside itself and reads ../../../models/templates/*.jinja."""
    wanted = (SUITE_IN_SDIST, TEMPLATES_IN_SDIST)
    if sdist.is_dir():
        root = sdist if (sdist / SUITE_IN_SDIST / "utils.py").is_file() else None
        if root is None:
            raise SystemExit(f"{sdist}: no {SUITE_IN_SDIST}/utils.py inside; give the llama-cpp-python sdist")
        for part in wanted:
            if (root / part).is_dir():
                shutil.copytree(root / part, work / part)
        return work / SUITE_IN_SDIST
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and any(f"/{w}/" in f"/{m.name}" for w in wanted)]
        if not any(f"/{SUITE_IN_SDIST}/" in f"/{m.name}" for m in members):
            raise SystemExit(f"{sdist}: no {SUITE_IN_SDIST} in this archive; give the llama-cpp-python 0.3.36 sdist")
        for member in members:
            inside = member.name.split("/", 1)[1]  # drop the sdist's top folder
            if ".." in Path(inside).parts:
                continue
            target = work / inside
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src:  # type: ignore[union-attr]
                target.write_bytes(src.read())
    return work / SUITE_IN_SDIST


def _shims(work: Path, model: str, server_bin: str | None) -> Path:
    shim_dir = work / "shim"
    shim_dir.mkdir()
    if server_bin:
        command = [str(Path(server_bin).resolve())]
    else:
        command = [sys.executable, "-m", "daemon", "serve"]
    shim = shim_dir / "llama-server"
    shim.write_text(SHIM.format(python=sys.executable, model=model, model_options=sorted(MODEL_OPTIONS),
                                draft_options=sorted(DRAFT_OPTIONS), dropped=sorted(DROPPED_OPTIONS),
                                command=command))
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    (shim_dir / "wget.py").write_text(WGET.format(model=model, lora=sorted(LORA_NAMES)))
    (shim_dir / "conformance_plugin.py").write_text(PLUGIN)
    return shim_dir


def _bundled_model() -> str:
    from config import Settings
    from daemon.model.files import bundled_model

    return str(bundled_model(Settings()))


def _outcomes(junit: Path) -> dict[str, str]:
    """test id (file::name[params]) -> passed | failed | error | skipped, from pytest's junit XML."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "error" and result.get(test_id) == "passed":
                    outcome = "error"  # a teardown error after a pass counts against it
        result[test_id] = outcome
    return result


def table(outcomes: dict[str, str]) -> str:
    per_file: dict[str, Counter] = defaultdict(Counter)
    for test_id, outcome in outcomes.items():
        per_file[test_id.split("::")[0]][outcome] += 1
    rows = [f"{'file':<36} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5} {'total':>6}"]
    total: Counter = Counter()
    for name in sorted(per_file):
        c = per_file[name]
        total.update(c)
        rows.append(f"{name.removeprefix('unit/'):<36} {c['passed']:>5} {c['failed']:>5} {c['error']:>5} "
                    f"{c['skipped']:>5} {sum(c.values()):>6}")
    rows.append(f"{'TOTAL':<36} {total['passed']:>5} {total['failed']:>5} {total['error']:>5} "
                f"{total['skipped']:>5} {sum(total.values()):>6}")
    return "\n".join(rows)


def compare(now: dict[str, str], before: dict[str, str]) -> str:
    rows = [f"{before.get(t, '-'):>8} -> {now.get(t, '-'):<8} {t}"
            for t in sorted(set(now) | set(before)) if now.get(t) != before.get(t)]
    return "\n".join(rows) or "no test changed outcome"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", type=Path, help="the llama-cpp-python 0.3.36 sdist (.tar.gz or unpacked folder)")
    parser.add_argument("--model", help="the GGUF every model reference becomes (default: the bundled Gemma 3 270M)")
    parser.add_argument("--server-bin", help="run against this llama-server binary instead of dormouse serve")
    parser.add_argument("--port", type=int, default=18180, help="the suite's PORT (default 18180)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one test may take (pytest-timeout)")
    parser.add_argument("--json", type=Path, help="write each test's outcome here")
    parser.add_argument("--compare", type=Path, help="an earlier --json file: list the tests that changed")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (the suite, shims, logs)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (test files, -k EXPR), after --")
    args = parser.parse_args(argv)
    if args.sdist is None or not args.sdist.exists():
        print(f"the suite comes from the llama-cpp-python 0.3.36 sdist, which this script does not fetch; get it with\n"
              f"    {GET_SDIST}\nand pass --sdist /tmp/sdist/llama_cpp_python-0.3.36.tar.gz", file=sys.stderr)
        return 2
    model = str(Path(args.model).resolve()) if args.model else _bundled_model()
    work = Path(tempfile.mkdtemp(prefix="llama-server-conformance-"))
    try:
        tests = _suite(args.sdist.resolve(), work)
        shim_dir = _shims(work, model, args.server_bin)
        state = work / "state"
        state.mkdir()
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(shim_dir / "llama-server"),
               "PATH": f"{shim_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(shim_dir), str(ROOT), os.environ.get("PYTHONPATH")])),
               "PORT": str(args.port), "DORMOUSE_STATE_DIR": str(state), "LLAMA_CACHE": str(work / "llama-cache")}
        for name in ("SLOW_TESTS", "DEBUG_EXTERNAL", "DORMOUSE_CONFIG"):
            env.pop(name, None)
        junit = work / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "not slow", "-p", "conformance_plugin", "-p", "no:cacheprovider",
                   "-q", "-rN", f"--timeout={args.timeout}", f"--junitxml={junit}", *(args.pytest_args or ["unit"])]
        started = time.monotonic()
        with open(work / "pytest.log", "w") as log:
            subprocess.run(command, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        elapsed = time.monotonic() - started
        if not junit.exists():
            print((work / "pytest.log").read_text()[-4000:], file=sys.stderr)
            return 1
        outcomes = _outcomes(junit)
        print(f"server: {args.server_bin or 'dormouse serve'}; model: {model}")
        print(table(outcomes))
        print(f"run time: {elapsed / 60:.1f} min; log: {work / 'pytest.log'}" + ("" if args.keep else " (removed)"))
        if args.json:
            args.json.write_text(json.dumps({"server": args.server_bin or "dormouse", "model": model,
                                             "seconds": round(elapsed), "outcomes": outcomes}, indent=1))
        if args.compare:
            print(compare(outcomes, json.loads(args.compare.read_text())["outcomes"]))
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
