"""The package layering, checked on the source (every import, function-level ones included):

    quantizers  <-  core  <-  exporters  <-  convert  <-  serve

``core`` is the set of ``convert`` modules that the exporters build on (errors, the Gemma 4
architecture, the checkpoint reader, SRC resolution, progress bars, prompt tokenization): :data:`CORE`. A module
may import only modules of its own layer or a lower one, and a core module only core
modules of ``convert``; so there is no import cycle between packages.

Run alone: ``.venv/bin/python -m pytest -q tests/test_import_graph.py``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("quantizers", "convert", "exporters", "serve")
CORE = frozenset({"convert.errors", "convert.gemma4", "convert.checkpoint", "convert.resolve", "convert.progress",
                  "convert.prompt"})
LAYERS = {"quantizers": 0, "core": 1, "exporters": 2, "convert": 3, "serve": 4}


def layer(module: str) -> str:
    return "core" if module in CORE else module.split(".")[0]


def imports() -> dict[str, set[str]]:
    """``{"package.module": {"package.module" it imports}}`` over every g4 module."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
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
                    if base in PACKAGES:  # from g4.quantizers import int8 / from . import x
                        targets |= {f"{base}.{a.name}" for a in node.names}
                    else:
                        targets.add(base)
                elif isinstance(node, ast.Import):
                    targets |= {a.name[3:] for a in node.names if a.name.startswith("g4.")}
            graph[module] = {t for t in targets if t != module}
    return graph


def test_every_import_follows_the_layering():
    graph = imports()
    assert CORE <= set(graph), sorted(CORE - set(graph))
    bad = [f"{m} ({layer(m)}) imports {t} ({layer(t)})"
           for m, targets in graph.items() for t in sorted(targets)
           if t.split(".")[0] in PACKAGES and LAYERS[layer(t)] > LAYERS[layer(m)]]
    assert not bad, "\n".join(bad)


def test_no_cycle_between_packages():
    graph = imports()
    edges = {(layer(m), layer(t)) for m, ts in graph.items() for t in ts
             if t.split(".")[0] in PACKAGES and layer(m) != layer(t)}
    assert not [(a, b) for a, b in edges if (b, a) in edges]


def test_click_commands_only_in_the_cli_modules():
    def is_command(d) -> bool:
        f = d.func if isinstance(d, ast.Call) else d
        return isinstance(f, ast.Attribute) and f.attr in ("command", "group")

    found = [f"{package}/{path.name}:{node.lineno} {node.name}"
             for package in PACKAGES for path in sorted((ROOT / package).glob("*.py")) if path.stem != "cli"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and any(is_command(d) for d in node.decorator_list)]
    assert not found, found
