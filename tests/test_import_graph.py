"""The package layering, read from the tree itself (every import, function-level ones included):

    quantizers  <-  core  <-  exporters  <-  convert  <-  serve

The layers are the folders pyproject.toml maps into ``g4.*``, in that order (:data:`LAYERS`): a
module may import modules of its own folder or of a lower one, never of a higher one, and no
chain of imports between modules comes back to where it started (so no import hides inside a
function to break a cycle).

Run alone: ``.venv/bin/python -m pytest -q tests/test_import_graph.py``.
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("quantizers", "core", "exporters", "convert", "serve")


def test_the_layers_are_the_packages_pyproject_installs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapped = pyproject["tool"]["setuptools"]["package-dir"]
    assert sorted(mapped) == sorted(f"g4.{p}" for p in LAYERS)
    assert all(mapped[f"g4.{p}"] == p for p in LAYERS)


def test_the_readme_layout_names_every_module():
    """README's Layout section has one bullet per folder (``- `core/`: ...``), and each bullet
    names every module file of that folder (``__init__.py`` aside)."""
    layout = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    bullets = {b.split("`", 2)[1].rstrip("/"): " ".join(b.split()) for b in layout.split("\n- ")[1:]}
    missing = [f"{package}/{path.name}" for package in LAYERS for path in sorted((ROOT / package).glob("*.py"))
               if path.stem != "__init__" and f"`{path.name}`" not in bullets.get(package, "")]
    assert missing == []


def imports() -> dict[str, set[str]]:
    """``{"package.module": {"package.module" it imports}}`` over every g4 module."""
    graph: dict[str, set[str]] = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).glob("*.py")):
            if path.stem == "__init__":
                continue
            module = f"{package}.{path.stem}"
            targets: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = f"{package}.{node.module}" if node.module else package
                    elif node.module and node.module.startswith("g4."):
                        base = node.module[3:]
                    else:
                        continue
                    if base in LAYERS:  # from g4.quantizers import int8 / from . import x
                        targets |= {f"{base}.{a.name}" for a in node.names}
                    else:
                        targets.add(base)
                elif isinstance(node, ast.Import):
                    targets |= {a.name[3:] for a in node.names if a.name.startswith("g4.")}
            graph[module] = {t for t in targets if t != module}
    return graph


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_every_import_is_of_a_module_that_exists():
    graph = imports()
    missing = [f"{m} imports {t}" for m, ts in graph.items() for t in sorted(ts) if t not in graph]
    assert not missing, "\n".join(missing)


def test_every_import_follows_the_layering():
    graph = imports()
    bad = [f"{m} imports {t} (a higher layer)" for m, ts in graph.items() for t in sorted(ts) if layer(t) > layer(m)]
    assert not bad, "\n".join(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_module_graph_has_no_cycle():
    assert cycles(imports()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = imports()
    graph["core.errors"] = graph["core.errors"] | {"core.prompt"}  # prompt imports errors
    assert ["core.errors", "core.prompt"] in cycles(graph)


def test_click_commands_only_in_the_cli_modules():
    def is_command(d) -> bool:
        f = d.func if isinstance(d, ast.Call) else d
        return isinstance(f, ast.Attribute) and f.attr in ("command", "group")

    found = [f"{package}/{path.name}:{node.lineno} {node.name}"
             for package in LAYERS for path in sorted((ROOT / package).glob("*.py")) if path.stem != "cli"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and any(is_command(d) for d in node.decorator_list)]
    assert not found, found


def test_the_command_lines_start_without_transformers():
    """``g4convert --help`` and an option's ``error:`` line come in about a second of imports:
    transformers (several seconds) is imported by the commands that run a model, not by the CLI."""
    code = "import sys, g4.convert.cli, g4.serve.cli; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'transformers'" not in loaded
