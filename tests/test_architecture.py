"""The layers' rules, read from the source with `ast` (issue #23, docs/ARCHITECTURE.md):

- arrows one way: catalog -> search_spaces -> models -> runners / placement -> advisor (the surface);
  no module imports one of a higher layer;
- no import cycle between modules;
- no private name (`_x`) imported across modules, nor read as `module._x`; a name imported from a
  module with an `__all__` is listed there;
- no library module over MAX_LINES lines (less the allow-list that must only shrink).

Imports anywhere in a file count: module level, inside functions, under `if TYPE_CHECKING:`.
`python tests/test_architecture.py` prints every finding.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folder -> (import name, layer rank). A module may import only from its own rank or lower ones.
# runners (measurement) and placement (slot profiles, assignment) sit side by side above models;
# placement reads telemetry from runners, so it ranks one above.
LAYERS = {
    "catalog": ("advisor.catalog", 0),
    "search_spaces": ("advisor.search_spaces", 1),
    "models": ("advisor.models", 2),
    "runners": ("advisor.runners", 3),
    "placement": ("advisor.placement", 4),
    "advisor": ("advisor", 5),
}
ROOT_PACKAGE = "advisor"  # advisor/__init__.py: the version and the search path, importable from every layer
MAX_LINES = 800
# Modules still over MAX_LINES (issue #23, item 2), with their length when listed: one may shrink,
# never grow, and leaves the list once it is under the limit.
OVER_MAX_LINES: dict[str, int] = {}


@lru_cache(maxsize=1)
def modules() -> dict[str, Path]:
    """Every library module by its import name."""
    out = {}
    for folder, (package, _) in LAYERS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def rank(module: str) -> int:
    if module == ROOT_PACKAGE:
        return -1
    best = ""
    for package, _ in LAYERS.values():
        if (module == package or module.startswith(package + ".")) and len(package) > len(best):
            best = package
    return next(r for p, r in LAYERS.values() if p == best)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = modules()[module].stem == "__init__"
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def imports(module: str) -> tuple[tuple[str, str | None, int], ...]:
    """(imported module, imported name or None, line) for every import of a library module in
    `module`'s file, and (module, `_attr`, line) for each `alias._attr` read off an imported module."""
    known = modules()
    tree = ast.parse(modules()[module].read_text(), filename=str(modules()[module]))
    found: list[tuple[str, str | None, int]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    found.append((a.name, None, node.lineno))
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            sibling = f"{module.rsplit('.', 1)[0]}.{source}"
            if source not in known and "." not in source and sibling in known:
                source = sibling  # a script's import of the file beside it (runners/command_guard.py)
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in known:  # `from package import module`
                    found.append((sub, None, node.lineno))
                    aliases[a.asname or a.name] = sub
                elif source in known:
                    found.append((source, a.name, node.lineno))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return tuple(found)


def where(module: str, line: int) -> str:
    return f"{modules()[module].relative_to(ROOT)}:{line}"


def upward_imports() -> list[str]:
    return [f"{where(m, line)}: {m} (layer {rank(m)}) imports {target} (layer {rank(target)})"
            for m in modules() for target, _, line in imports(m) if rank(target) > rank(m)]


def private_imports() -> list[str]:
    return [f"{where(m, line)}: {m} uses {target}.{name}"
            for m in modules() for target, name, line in imports(m)
            if name and name.startswith("_") and not name.startswith("__") and target != m]


def declared(module: str) -> set[str] | None:
    """The names of `module`'s __all__, None when it has none."""
    for node in ast.parse(modules()[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def unlisted_imports() -> list[str]:
    """Names imported from a module that has an __all__ without being in it."""
    out = []
    for m in modules():
        for target, name, line in imports(m):
            names = declared(target) if name and target != m else None
            if names is not None and name not in names:
                out.append(f"{where(m, line)}: {m} imports {target}.{name}, not in its __all__")
    return out


def import_graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in imports(m) if t != m} for m in modules()}


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def long_modules() -> dict[str, int]:
    return {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}


def test_the_check_sees_the_library():
    mods = modules()
    assert "advisor.models.predict" in mods and "advisor.cli" in mods and "advisor.runners.measure" in mods
    assert any(t == "advisor.models.predict" for t, _, _ in imports("advisor.api"))


def test_no_upward_import():
    assert upward_imports() == []


def test_no_import_cycle():
    assert import_cycles() == []


def test_no_private_name_across_modules():
    assert private_imports() == []


def test_what_other_modules_import_is_in_all():
    assert unlisted_imports() == []


def test_no_module_over_the_line_limit():
    long = long_modules()
    assert {m: n for m, n in long.items() if m not in OVER_MAX_LINES} == {}, f"over {MAX_LINES} lines"
    assert {m: n for m, n in long.items() if n > OVER_MAX_LINES[m]} == {}, "an allow-listed module grew"
    assert [m for m in OVER_MAX_LINES if m not in long] == [], "under the limit now: take it off OVER_MAX_LINES"


def test_the_check_catches_each_kind(tmp_path, monkeypatch):
    """A fake layer tree with one of each fault: the checks must name them."""
    for folder in LAYERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "catalog" / "a.py").write_text("from advisor.api import run\n")          # upward
    (tmp_path / "models" / "b.py").write_text("def f():\n    from advisor.models.c import g\n")
    (tmp_path / "models" / "c.py").write_text("from advisor.models import b\nfrom advisor.models.d import _x\n")
    (tmp_path / "models" / "d.py").write_text("__all__ = []\n_x = 1\n" + "y = 1\n" * MAX_LINES)
    (tmp_path / "advisor" / "api.py").write_text("def run():\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules.cache_clear()
    imports.cache_clear()
    try:
        assert len(upward_imports()) == 1 and "advisor.api" in upward_imports()[0]
        assert import_cycles() == [["advisor.models.b", "advisor.models.c"]]
        assert len(private_imports()) == 1 and "advisor.models.d._x" in private_imports()[0]
        assert len(unlisted_imports()) == 1 and "advisor.models.d._x" in unlisted_imports()[0]
        assert long_modules() == {"advisor.models.d": MAX_LINES + 2}
    finally:
        monkeypatch.undo()
        modules.cache_clear()
        imports.cache_clear()

if __name__ == "__main__":
    for title, items in (("upward", upward_imports()), ("private", private_imports()),
                         ("not in __all__", unlisted_imports()),
                         ("cycles", [" <-> ".join(c) for c in import_cycles()]),
                         ("long", [f"{m}: {n}" for m, n in sorted(long_modules().items(), key=lambda x: -x[1])])):
        print(f"== {title}: {len(items)}")
        print("\n".join(items))
