"""The README and docs/ cite evidence that exists and commands that parse.

- every `benchmarks/results/...` path they cite is in the repository (`{a,b}` alternatives expanded);
- every `python -m benchmarks.<script> --flag ...` names a script that exists and flags it defines
  (read from its `add_argument` calls with `ast`, nothing imported or run);
- every `jaxserve <command> ...` parses with the real command-line parser (serve, config, plan,
  convert) or the proxy's.
"""

from __future__ import annotations

import ast
import itertools
import re
import shlex
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_RESULT = re.compile(r"benchmarks/results/[\w./{},*-]*[\w/}*]")
_COMMAND_START = re.compile(
    r"(?:^|[`$]\s*|&&\s*|\|\s*)((?:\S*/)?(?:python3?|\.venv/bin/python) -m benchmarks\.\w+[^`\n]*"
    r"|(?:\S*/)?jaxserve (?:serve|config|plan|convert|proxy)\b[^`\n]*)"
)


def _expand(path: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", path)
    options = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def _cited_results() -> list[tuple[str, str]]:
    cited = []
    for page in PAGES:
        for match in _RESULT.findall(page.read_text()):
            cited += [(page.name, path) for path in _expand(match)]
    return cited


@pytest.mark.parametrize(("page", "path"), sorted(set(_cited_results())))
def test_cited_result_files_exist(page, path):
    target = REPO_ROOT / path
    if "*" in path:  # a family of files
        assert list(target.parent.glob(target.name)), f"{page}: nothing matches {path}"
    else:
        assert target.exists(), f"{page} cites {path}, which is not in the repository"


def _commands() -> list[tuple[str, str]]:
    """(page, command) for each documented invocation; a bare `jaxserve proxy` in prose is a name,
    not a command, and a command continued on the next line (`\\`, or cut before an option's
    value) is checked up to what its line holds."""
    found = []
    for page in PAGES:
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # shell line continuations
        for line in text.splitlines():
            for match in _COMMAND_START.finditer(line):
                command = re.split(r"\s+#|\s+\(|\s*`|\s+\[", match.group(1))[0].strip().rstrip(".,;:&").strip()
                if len(command.split()) > 2:
                    found.append((page.name, re.sub(r"\s+--set$", "", command)))
    return sorted(set(found))


def _words(command: str) -> list[str]:
    command = command.replace("...", "").replace("\\", " ")
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote cut by the line end: split on whitespace
        return command.split()


def _script_flags(module: str) -> set[str]:
    path = REPO_ROOT / (module.replace(".", "/") + ".py")
    assert path.exists(), f"no script {path.relative_to(REPO_ROOT)}"
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {
                arg.value for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
            }
    return flags


COMMANDS = _commands()


def test_the_docs_document_commands():
    assert (
        sum(1 for _, c in COMMANDS if "benchmarks." in c) >= 10 and sum(1 for _, c in COMMANDS if "jaxserve" in c) >= 10
    )


@pytest.mark.parametrize(("page", "command"), COMMANDS)
def test_documented_commands_parse(page, command):
    words = _words(command)
    if "-m" in words:
        module = words[words.index("-m") + 1]
        known = _script_flags(module)
        used = {w.split("=")[0] for w in words if w.startswith("--")}
        assert used <= known | {"--help"}, f"{page}: `{command}` uses {sorted(used - known)}, not flags of {module}"
        return
    args = words[words.index(next(w for w in words if w.endswith("jaxserve"))) + 1 :]
    if args[0] == "proxy":
        from server.proxy_config import _parser as proxy_parser

        proxy_parser().parse_args(args[1:])
        return
    from server.cli import _parser

    try:
        _parser().parse_args(args)
    except SystemExit as exit_:
        pytest.fail(f"{page}: `{command}` does not parse (exit {exit_.code})")
