"""The layering rule of docs/architecture.md, checked on the source (AST only: nothing is imported).

    server -> runtime -> (models, paged_kv) -> pallas_kernels;  configs: imported by all, imports none of ours
    inside runtime/: (engine, aot) -> parallel -> steps -> scheduling -> runtime/*.py
                     (kv_transfer -> scheduling; structured_output -> runtime/*.py; speculative -> steps)

Every `import x` / `from x import y` (relative ones resolved) of every module under the six
packages is an edge, wherever it sits: module level, inside a function (the lazy-import
pattern), or under `if TYPE_CHECKING:`. So are the strings that name a module to be imported
later: `importlib.import_module("pkg.mod")` and the registries' `"pkg.mod:attribute"` targets.

- layering: an edge may point only down the orders above (or stay inside its package), but for
  the few `LAYERING_EXCEPTIONS`, each with its reason;
- cycles: none between modules, over every edge but `TYPE_CHECKING` imports (never executed).
  Imports inside functions and registry targets count too: a cycle that only closes at run time
  (the lazy-import pattern) is still a cycle, and the two this test was written to remove
  (models.abstract -> models.model -> models.orbax_io -> models.abstract, and the engine's thread
  client <-> process client) both closed inside functions;
- `server/` imports no JAX (it runs in the HTTP process, which starts no JAX backend); one test
  also imports `server.cli` in a fresh interpreter to check that nothing below pulls JAX in;
- every name an import uses is a module (a move leaves no stale `importlib` string behind), and
  runtime/ keeps at most 12 top-level modules.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "models", "paged_kv", "pallas_kernels", "runtime", "server")

# Each package and the packages of ours below it, which it may import (its own is always allowed).
# models/ and paged_kv/ share a layer and import neither each other nor anything above them.
MAY_IMPORT = {
    "configs": set(),
    "pallas_kernels": {"configs"},
    "paged_kv": {"configs", "pallas_kernels"},
    "models": {"configs", "pallas_kernels"},
    "runtime": {"configs", "models", "paged_kv", "pallas_kernels"},
    "server": {"configs", "runtime", "models", "paged_kv", "pallas_kernels"},
}

# Inside runtime/: each sub-package and the sub-packages it may import. Every one may import runtime/'s
# top-level modules ("base": types, validation, engine_config, registry, buckets, scheduled), which import
# no sub-package; runtime/__init__.py may import anything.
RUNTIME_MAY_IMPORT = {
    "base": set(),
    "scheduling": {"base"},
    "structured_output": {"base"},
    "steps": {"base"},  # the scheduler's plan comes through runtime/scheduled.py
    "kv_transfer": {"base", "scheduling"},
    "parallel": {"base", "scheduling", "steps"},
    "aot": {"base", "scheduling", "steps", "parallel"},
    "speculative": {"base", "scheduling", "steps"},
    "engine": {"base", "scheduling", "structured_output", "steps", "kv_transfer", "parallel", "speculative"},
}

# Edges that break a rule on purpose, each with its reason (docs/architecture.md lists them too).
# An entry here is a design decision, not a way to make this test pass.
LAYERING_EXCEPTIONS: dict[tuple[str, str], str] = {}

_REGISTRY_TARGET = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class Edge:
    source: str  # dotted module name
    target: str  # dotted module name (ours), the deepest module the statement names
    named: str  # what the statement requires to be a module: `import a.b` a.b; `from a.b import c` a.b
    line: int
    kind: str  # "module" | "lazy" (inside a function) | "type_checking" | "dynamic" (import_module) | "registry"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            files[module_name(path)] = path
    return files


def _resolve(name: str, modules: set[str]) -> str | None:
    """The deepest module of ours that `name` (a module, or module.attribute) names."""
    if name.split(".")[0] not in PACKAGES:
        return None
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, modules: set[str]) -> list[Edge]:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    edges: list[Edge] = []

    def add(target: str | None, line: int, kind: str, named: str | None = None) -> None:
        resolved = _resolve(target, modules) if target else None
        if resolved is not None and resolved != name:
            edges.append(Edge(name, resolved, named or target, line, kind))

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "lazy" if kind == "module" else kind
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type_checking")
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, kind)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in (or is)
                package = name.split(".")
                if not is_package:
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:  # `from pkg import submodule` names the submodule
                add(f"{base}.{alias.name}", node.lineno, kind, named=base)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (
                called in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                add(node.args[0].value, node.lineno, "dynamic")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _REGISTRY_TARGET.match(node.value)
            if match:
                add(match.group(1), node.lineno, "registry")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                continue  # a docstring (or a bare string): prose, not a registry entry
            visit(child, kind)

    visit(tree, "module")
    return edges


def import_graph() -> list[Edge]:
    files = source_files()
    modules = set(files)
    return [edge for name, path in files.items() for edge in imports_of(name, path, modules)]


def runtime_group(module: str) -> str | None:
    """The runtime sub-package a module is in; "base" for runtime/'s top-level modules; None outside runtime/."""
    parts = module.split(".")
    if parts[0] != "runtime" or len(parts) == 1:
        return None  # runtime/__init__.py is the public entry point (`from runtime import LLM`): above all
    return parts[1] if parts[1] in RUNTIME_MAY_IMPORT else "base"


def layering_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = e.source.split(".")[0], e.target.split(".")[0]
        if src == dst or dst in MAY_IMPORT[src] or (e.source, e.target) in LAYERING_EXCEPTIONS:
            continue
        bad.append(
            f"{e.source} -> {e.target} ({e.kind} import, line {e.line}): {src}/ may import only "
            f"{sorted(MAY_IMPORT[src]) or 'nothing of ours'}"
        )
    for e in edges:
        src, dst = runtime_group(e.source), runtime_group(e.target)
        if (
            src is None
            or dst is None
            or src == dst
            or dst in RUNTIME_MAY_IMPORT[src]
            or (e.source, e.target) in LAYERING_EXCEPTIONS
        ):
            continue
        bad.append(
            f"{e.source} -> {e.target} ({e.kind} import, line {e.line}): runtime/{src} may import only "
            f"runtime/{sorted(RUNTIME_MAY_IMPORT[src])} and runtime/'s top-level modules"
        )
    return bad


def import_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.kind != "type_checking":
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # iterative Tarjan: the graph is deep enough to matter
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
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
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(components)


def _describe(component: list[str], edges: list[Edge]) -> str:
    members = set(component)
    inner = sorted(
        {
            f"{e.source} -> {e.target} ({e.kind}, line {e.line})"
            for e in edges
            if e.source in members and e.target in members and e.kind != "type_checking"
        }
    )
    return "cycle between " + ", ".join(component) + ":\n    " + "\n    ".join(inner)


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_graph()


def test_imports_point_down_the_layers(edges):
    bad = layering_violations(edges)
    assert not bad, "\n".join(bad)


def test_no_import_cycles(edges):
    cycles = import_cycles(edges)
    assert not cycles, "\n".join(_describe(c, edges) for c in cycles)


def test_the_server_imports_no_jax():
    files = {name: path for name, path in source_files().items() if name.split(".")[0] == "server"}
    offenders = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("jax", "jaxlib")]
    assert not offenders, "\n".join(offenders)


def test_the_server_cli_starts_without_jax():
    """What the AST check cannot see: nothing `jaxserve`'s entry point imports, however deep, imports JAX."""
    from import_testing import imports_jax

    assert not imports_jax("server.cli", "server.app", "runtime.types", "runtime.validation")


def test_every_import_of_ours_names_a_module(edges):
    """A moved or renamed module leaves no stale name behind: not in an import, nor in an
    `import_module` string or a registry target (those fail only when they run)."""
    modules = set(source_files())
    stale = sorted(
        {f"{e.source}:{e.line} names {e.named}, which is no module" for e in edges if e.named not in modules}
    )
    assert not stale, "\n".join(stale)


def test_runtime_top_level_stays_small():
    """At most 12 modules at runtime/'s top level (`__init__.py` included): the rest live in the
    sub-package that owns them."""
    top = sorted(p.name for p in (REPO_ROOT / "runtime").glob("*.py"))
    assert len(top) <= 12, top


def test_layering_exceptions_are_still_needed(edges):
    used = {(e.source, e.target) for e in edges}
    assert [pair for pair in LAYERING_EXCEPTIONS if pair not in used] == []


# ---- the checker checks: each rule fails on a bad import ---------------------------------------


def _edges_of(tmp_path: Path, name: str, source: str, modules: set[str]) -> list[Edge]:
    path = tmp_path / (name.rpartition(".")[2] + ".py")
    path.write_text(source)
    return imports_of(name, path, modules)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    modules = {
        "runtime",
        "runtime.engine",
        "runtime.engine.llm_engine",
        "server",
        "server.app",
        "models",
        "models.model",
    }
    source = (
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from . import llm_engine\n"
        "from .. import app\n"
        "if TYPE_CHECKING:\n"
        "    from models.model import Model\n"
        "def f():\n"
        "    import server.app\n"
        "    importlib.import_module('models.model')\n"
        "FACTORY = 'server.app:make'\n"
        "'''server.app:documented only'''\n"
    )
    found = {(e.target, e.kind) for e in _edges_of(tmp_path, "runtime.engine.x", source, modules)}
    assert found == {
        ("runtime.engine.llm_engine", "module"),
        ("runtime", "module"),
        ("models.model", "type_checking"),
        ("server.app", "lazy"),
        ("models.model", "dynamic"),
        ("server.app", "registry"),
    }


def test_the_checker_fails_an_upward_import_and_a_cycle(tmp_path):
    modules = {
        "models.a",
        "models.b",
        "runtime",
        "runtime.c",
        "runtime.steps.d",
        "runtime.scheduling.e",
        "runtime.parallel.f",
    }
    up = _edges_of(tmp_path, "models.a", "def f():\n    from runtime.c import thing\n", modules)
    assert len(layering_violations(up)) == 1
    up_inside = _edges_of(tmp_path, "runtime.scheduling.e", "from runtime.steps import d\n", modules)
    assert len(layering_violations(up_inside)) == 1
    assert layering_violations(_edges_of(tmp_path, "runtime.parallel.f", "import runtime.steps.d\n", modules)) == []
    sideways = _edges_of(tmp_path, "runtime.steps.d", "import runtime.scheduling.e\n", modules)
    assert len(layering_violations(sideways)) == 1  # steps get the scheduler's plan from runtime/scheduled.py
    stale = _edges_of(tmp_path, "models.b", "import importlib\nimportlib.import_module('runtime.gone')\n", modules)
    assert [e.named for e in stale] == ["runtime.gone"]
    loop = _edges_of(tmp_path, "models.a", "import models.b\n", modules) + _edges_of(
        tmp_path, "models.b", "def g():\n    from models import a\n", modules
    )
    assert import_cycles(loop) == [["models.a", "models.b"]]
    typed = _edges_of(
        tmp_path, "models.b", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import models.a\n", modules
    )
    assert import_cycles(_edges_of(tmp_path, "models.a", "import models.b\n", modules) + typed) == []
