"""The package's layers (docs/ARCHITECTURE.md), enforced on the source: every import of every module of ``hf_structkv``
— at module level, inside functions (lazy) or under ``TYPE_CHECKING`` — is parsed with ``ast`` and must point to a
module of the same or a lower layer; the module import graph has no circle; no module imports another module's
``_private`` name. The checker itself is tested on a small synthetic tree that breaks each rule once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hf_structkv",)

# Bottom to top; a module belongs to the layer of the longest prefix that names it. Keep in step with
# docs/ARCHITECTURE.md.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "hf_structkv.version",
        "hf_structkv.validation",
        "hf_structkv.user_warnings",
        "hf_structkv.prompts",
        "hf_structkv.models",
    ),
    ("hf_structkv.quant",),
    ("hf_structkv.structure",),
    ("hf_structkv.persistence",),
    ("hf_structkv.attention",),
    ("hf_structkv.policy",),
    ("hf_structkv.cache",),
    ("hf_structkv.generation", "hf_structkv.structured_generation", "hf_structkv.sql_generation"),
    ("hf_structkv.eval",),
    ("hf_structkv.compaction", "hf_structkv.calibration"),
    ("hf_structkv.cli", "hf_structkv"),
)


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``root / package`` (``pkg/__init__.py``: ``pkg``)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import in the file, wherever it sits.

    ``from pkg import x`` names the module ``pkg.x`` when that is a module of the tree, else the name ``x`` of
    ``pkg``; only imports of modules in ``known`` are returned.
    """
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:
                    found.append((submodule, None, node.lineno))
                elif target in known:
                    found.append((target, alias.name, node.lineno))
    return found


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int:
    """The index of the layer whose longest matching prefix names ``module``."""
    best, best_len = -1, -1
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), Tarjan's way."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(root: Path, packages: tuple[str, ...], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every broken rule, one line each: a module outside the layers, an upward import, a private name, a circle."""
    modules = module_files(root, packages)
    known = set(modules)
    problems, graph = [], {}
    for name, path in modules.items():
        own = layer_of(name, layers)
        if own < 0:
            problems.append(f"{name} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")
        graph[name] = set()
        for target, imported, line in imports_of(name, path, known):
            graph[name].add(target)
            where = f"{path.relative_to(root)}:{line}"
            if layer_of(target, layers) > own:
                problems.append(f"{where}: {name} (layer {own}) imports {target} (layer {layer_of(target, layers)})")
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                problems.append(f"{where}: {name} imports the private name {imported} of {target}")
    problems += [f"import circle: {' -> '.join(component)}" for component in circles(graph)]
    return problems


def test_the_package_keeps_its_layers():
    assert violations(ROOT, PACKAGES, LAYERS) == []


def test_every_layer_names_an_existing_module():
    modules = set(module_files(ROOT, PACKAGES))
    missing = [prefix for prefixes in LAYERS for prefix in prefixes if prefix not in modules]
    assert missing == []


@pytest.fixture
def broken_tree(tmp_path: Path) -> Path:
    """A two-layer package ``pkg`` (``pkg.low`` below ``pkg.high``) whose modules break every rule once."""
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from ..high.b import g  # lazy, and upward\n",
        "pkg/low/c.py": "from .d import x\n",
        "pkg/low/d.py": "from .c import y\nfrom .a import _hidden\n",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from ..low import a\n",
        "pkg/stray.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_checker_reports_an_upward_import_a_circle_a_private_name_and_a_stray_module(broken_tree: Path):
    layers = (("pkg.low",), ("pkg.high", "pkg"))
    problems = violations(broken_tree, ("pkg",), layers)
    assert any("pkg.low.a (layer 0) imports pkg.high.b (layer 1)" in p for p in problems)
    assert "import circle: pkg.low.c -> pkg.low.d" in problems
    assert "import circle: pkg.high.b -> pkg.low.a" in problems
    assert any("imports the private name _hidden of pkg.low.a" in p for p in problems)
    problems = violations(broken_tree, ("pkg",), (("pkg.low",), ("pkg.high",)))
    assert any(p.startswith("pkg.stray is in no layer") for p in problems)
