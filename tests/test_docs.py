"""docs/architecture.md cannot rot: what it names in backticks exists, and it names every module.

- a path (`runtime/steps/sampler.py`, `runtime/steps/`, `docs/benchmarks.md`) is a file or directory;
- `path.py:name` and `path.py:Class.method` are defined in that file (read with `ast`, not imported);
- a dotted name of ours (`runtime.types.SamplingParams`, `models.convert`) is a module, or a module
  and what it defines;
- every module of the six packages but the `__init__.py`s has its line on the page;
- "The path of one request" states as many hops as it lists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "architecture.md"
PACKAGES = ("configs", "models", "paged_kv", "pallas_kernels", "runtime", "server")

_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(
    r"(?<![\w./])((?:" + "|".join(PACKAGES + ("tests", "benchmarks", "docs")) + r")/[\w./-]*)"
    r"(?::([A-Za-z_][\w.]*))?"
)
_DOTTED = re.compile(r"(?<![\w./])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_][\w.]*))?")


def _spans(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # fenced blocks: diagrams, not references
    return _CODE_SPAN.findall(text)


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def _defines(path: Path, attribute: str) -> bool:
    """`attribute` (`name` or `Class.member`) is defined at the top of `path`'s module."""
    body = ast.parse(path.read_text(), str(path)).body
    for part in attribute.split("."):
        node = _definitions(body).get(part)
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _module_file(dotted: str) -> Path | None:
    base = REPO_ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def broken_references(text: str) -> list[str]:
    broken = []
    for span in _spans(text):
        for match in _PATH.finditer(span):
            path, attribute = match.group(1).rstrip("."), match.group(2)
            target = REPO_ROOT / path
            if not target.exists():
                broken.append(f"`{span}`: {path} does not exist")
            elif attribute and not (target.suffix == ".py" and _defines(target, attribute)):
                broken.append(f"`{span}`: {path} defines no {attribute}")
        for match in _DOTTED.finditer(span):
            parts, attribute = match.group(1).split("."), match.group(2)
            for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
                module = _module_file(".".join(parts[:cut]))
                if module is not None:
                    rest = ".".join(parts[cut:] + ([attribute] if attribute else []))
                    if cut < 2 and rest:
                        module = None  # `runtime.whatever`: a package attribute is not a module path
                    elif rest and not _defines(module, rest):
                        broken.append(f"`{span}`: {'.'.join(parts[:cut])} defines no {rest}")
                    break
            if module is None:
                broken.append(f"`{span}`: {match.group(1)} is no module")
    return broken


def test_every_name_on_the_architecture_page_exists():
    broken = broken_references(PAGE.read_text())
    assert not broken, "\n".join(broken)


def test_the_architecture_page_names_every_module():
    named = {match.group(1) for span in _spans(PAGE.read_text()) for match in _PATH.finditer(span)}
    missing = sorted(
        str(p.relative_to(REPO_ROOT))
        for package in PACKAGES
        for p in (REPO_ROOT / package).rglob("*.py")
        if p.name != "__init__.py" and str(p.relative_to(REPO_ROOT)) not in named
    )
    assert not missing, "docs/architecture.md has no line for:\n" + "\n".join(missing)


def test_the_request_path_counts_its_hops():
    section = PAGE.read_text().split("## The path of one request", 1)[1].split("\n## ", 1)[0]
    hops = re.findall(r"^(\d+)\. ", section, flags=re.M)
    assert [int(n) for n in hops] == list(range(1, len(hops) + 1))
    assert re.search(rf"\b{len(hops)} hops\b", section), f"the section lists {len(hops)} hops but says otherwise"


def test_the_checker_catches_what_rots():
    page = (
        "`runtime/steps/sampler.py:sample` `runtime/nowhere.py` `runtime/steps/sampler.py:nothing` "
        "`runtime.steps.table_host.RequestTableHost.plan` `runtime.step.TokenFeed` "
        "`runtime.types.NoSuchThing` `server/app.py:_chat_completions` `runtime/steps/`"
    )
    assert broken_references(page) == [
        "`runtime/nowhere.py`: runtime/nowhere.py does not exist",
        "`runtime/steps/sampler.py:nothing`: runtime/steps/sampler.py defines no nothing",
        "`runtime.step.TokenFeed`: runtime.step.TokenFeed is no module",
        "`runtime.types.NoSuchThing`: runtime.types defines no NoSuchThing",
    ]
