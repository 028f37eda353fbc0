"""The HTTP layer's layout holds (daemon/http/__init__.py): read from the
source, not imported, so a lazy import inside a function counts as much as
one at the top.

- no import circle among the product's modules;
- arrows point down only: app -> admin, status -> dialects -> core -> keys,
  errors; the core names no dialect, in its imports or its code;
- a dialect leans on another only where listed below (what is left to pull
  into the core), so a new lean fails here;
- no product file over 600 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ROOT / "daemon"
HTTP = "daemon.http"
DIALECTS = ("openai", "responses", "anthropic", "ollama", "llama_server")
MAX_LINES = 600

# Where one dialect still uses another's code today: each is a piece left to
# move into the core (or to a shared module), not a shape to copy.
CROSS_DIALECT: set[tuple[str, str]] = set()  # none left: the shared reading is core/events.py


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files() -> list[Path]:
    return sorted(p for p in PRODUCT.rglob("*.py") if "__pycache__" not in p.parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The product modules this file imports, anywhere in it (`from pkg import mod` names mod)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    return {m for m in found if m in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = product_files()
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) - {module_name(p)} for p in files}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle_and_clears_a_tree():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_the_http_layer_or_the_metrics(graph):
    ours = [c for c in circles(graph) if any(m.startswith((HTTP, "daemon.metrics")) for m in c)]
    assert ours == []


def layer(module: str) -> int | None:
    """0: keys, errors, cold_start (the app's plumbing the core uses); 1: core; 2: dialects;
    3: admin, status, tool_routes and vertex_predict (it sends its instances to the other routes); 4: the app. None: not in the HTTP layer, or agent (a TCP server of its own)."""
    if not module.startswith(HTTP + ".") or module == f"{HTTP}.agent":
        return None
    part = module.split(".")[2]
    return {"keys": 0, "errors": 0, "cold_start": 0, "core": 1, "dialects": 2, "admin": 3, "status": 3,
            "vertex_predict": 3, "tool_routes": 3, "app": 4}[part]


def test_every_http_module_has_a_layer(graph):
    for module in graph:
        if module.startswith(HTTP + ".") and module != f"{HTTP}.agent":
            assert layer(module) is not None, module


def test_arrows_point_down_only(graph):
    up = [(m, d) for m, deps in graph.items() for d in deps
          if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert up == []


def test_nothing_outside_the_http_layer_imports_into_it_but_the_server(graph):
    reaching = {m for m, deps in graph.items() if not m.startswith(HTTP) and any(d.startswith(HTTP) for d in deps)}
    assert reaching <= {"daemon.server"}


def test_the_core_names_no_dialect(graph):
    core = [p for p in (PRODUCT / "http" / "core").rglob("*.py")]
    assert len(core) >= 5
    for path in core:
        assert not any(d.startswith(f"{HTTP}.dialects") for d in graph[module_name(path)]), path
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
        named = {n for n in names for d in DIALECTS if d.replace("_", "") in n.lower().replace("_", "")}
        assert named == set(), path


# A dialect's own type names, as the core's code would spell them (imports, classes, annotations, strings).
DIALECT_IDENTIFIERS = re.compile(r"ChatCompletion|Anthropic|Ollama")


def code_of(path: Path) -> str:
    """The file's code without its comments and docstrings: the words that
    describe a field's origin may stay, an identifier may not."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)  # comments are dropped by the parser


def test_the_dialect_identifier_finder_sees_code_and_not_words(tmp_path):
    words = tmp_path / "words.py"
    words.write_text('"""Ollama\'s body maps onto it."""\n# as ChatCompletionRequest does\n'
                     'def f():\n    """Anthropic\'s too."""\n    return 1\n')
    assert DIALECT_IDENTIFIERS.findall(code_of(words)) == []
    code = tmp_path / "code.py"
    code.write_text("from x import ChatCompletionRequest\nclass AnthropicBody:\n    pass\n")
    assert DIALECT_IDENTIFIERS.findall(code_of(code)) == ["ChatCompletion", "Anthropic"]


def test_no_core_file_names_a_dialect_type():
    core = sorted((PRODUCT / "http" / "core").rglob("*.py"))
    assert len(core) >= 5
    found = {str(p.relative_to(ROOT)): DIALECT_IDENTIFIERS.findall(code_of(p)) for p in core}
    assert {p: names for p, names in found.items() if names} == {}


# A dialect by name in the core's code (its strings: a field's description shows in /openapi.json for every dialect).
DIALECT_NAMES = re.compile(r"OpenAI|Anthropic|Ollama|llama-server|llama_server", re.IGNORECASE)


def test_no_core_string_names_a_dialect():
    core = sorted((PRODUCT / "http" / "core").rglob("*.py"))
    found = {str(p.relative_to(ROOT)): DIALECT_NAMES.findall(code_of(p)) for p in core}
    assert {p: names for p, names in found.items() if names} == {}


def dialect_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[3] if parts[:3] == ["daemon", "http", "dialects"] and len(parts) > 3 else None


def test_each_dialect_is_a_package_of_its_own():
    found = sorted(p.name for p in (PRODUCT / "http" / "dialects").iterdir() if (p / "__init__.py").exists())
    assert found == sorted(DIALECTS)


def test_a_dialect_leans_on_another_only_where_listed(graph):
    leans = {(dialect_of(m), dialect_of(d)) for m, deps in graph.items() for d in deps
             if dialect_of(m) and dialect_of(d) and dialect_of(m) != dialect_of(d)}
    assert leans == CROSS_DIALECT  # one gone: take it off the list; one new: move the shared code to the core


def test_no_product_file_over_600_lines():
    """Every file of the daemon, the state machine and the configuration (issue 28): a file past the limit is
    split along a seam that is one idea, not listed here."""
    files = product_files() + sorted(p for top in ("statemachine", "config") for p in (ROOT / top).rglob("*.py")
                                     if "__pycache__" not in p.parts)
    assert len(files) > 100 and all(any(p.is_relative_to(ROOT / top) for p in files)
                                    for top in ("statemachine", "config"))  # the walk found them
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
