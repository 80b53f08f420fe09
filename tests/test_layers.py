"""The package's folders are its layers: the import graph, read from the source, has no cycle
between modules and no import against the arrows the packages' docstrings state."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mars_local"

# package -> the packages it may import (besides itself); cli may import anything, nothing imports cli
ALLOWED = {
    "core": set(),
    "llama": {"core"},
    "chat": {"core", "llama"},
    "models": {"core"},
    "speculate": {"core", "llama", "chat"},
    "batch": {"core", "llama", "chat", "models", "speculate"},
    "server": {"core", "llama", "chat", "models", "speculate"},
    "bench": {"core", "llama", "chat", "models", "speculate"},
    "cli": {"core", "llama", "chat", "models", "speculate", "batch", "server", "bench", ""},
    "": {"core", "speculate", "cli"},  # mars_local/__init__.py (lazy exports) and __main__.py
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``path`` names, made absolute."""
    if not node.level:
        return node.module or ""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path) -> set[str]:
    """Every mars_local module ``path`` imports, at any depth (function-level imports included;
    TYPE_CHECKING blocks too: a type's home is a dependency)."""
    me = module_name(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            target = absolute(path, node)
            if not target.startswith("mars_local"):
                continue
            for alias in node.names:  # `from . import x` may name a module
                sub = f"{target}.{alias.name}"
                out.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (PKG.parent / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mars_local")}
    out.discard(me)
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PKG.rglob("*.py")}


def layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else ""


def test_no_import_goes_against_the_layers():
    bad = []
    for mod, deps in graph().items():
        here = layer(mod)
        for dep in deps:
            there = layer(dep)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_no_module_import_cycles():
    g = graph()
    # a package's __init__ is its parent: an import of a submodule runs it first, not a cycle
    edges = {m: {d for d in deps if d in g and not m.startswith(d + ".")} for m, deps in g.items()}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(edges[m]):
            visit(d)
        stack.pop()

    for m in sorted(edges):
        visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


# modules outside llama/ that may call llama.cpp, and why
LLAMA_CPP_CALLERS = {
    "mars_local.speculate.grammar": "llama.cpp's grammar sampler, a per-generation state of the loop",
    "mars_local.speculate.native": "the patched build's verify kernel",
    "mars_local.bench.peers": "llama-cpp-python's own Llama, run as a peer",
}


def calls_llama_cpp(path: Path) -> bool:
    """Whether ``path`` imports llama_cpp, or llama.cpp's ctypes API ``C`` from mars_local.llama."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "llama_cpp" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            target = absolute(path, node)
            if target.split(".")[0] == "llama_cpp":
                return True
            if target.startswith("mars_local.llama") and any(a.name == "C" for a in node.names):
                return True
    return False


def test_only_the_llama_package_calls_llama_cpp():
    callers = {module_name(p) for p in PKG.rglob("*.py") if layer(module_name(p)) != "llama" and calls_llama_cpp(p)}
    assert callers == set(LLAMA_CPP_CALLERS), sorted(callers ^ set(LLAMA_CPP_CALLERS))


def test_the_checker_sees_imports():
    g = graph()
    assert "mars_local.core.errors" in g["mars_local.speculate.engine"]
    assert "mars_local.llama.runtime" in g["mars_local.llama.streams"]
    assert layer("mars_local.cli.main") == "cli" and layer("mars_local.__main__") == ""
    assert calls_llama_cpp(PKG / "llama" / "runtime.py") and not calls_llama_cpp(PKG / "chat" / "builtin.py")
