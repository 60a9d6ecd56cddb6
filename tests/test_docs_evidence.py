"""The README and docs/ cite evidence that exists and commands that parse.

- every `benchmarks/results/...` path they cite is in the repository (`{a,b}` alternatives expanded);
- every `python -m benchmarks.<script> --flag ...` names a script that exists and flags it defines
  (read from its `add_argument` calls with `ast`, nothing imported or run);
- every `jaxserve <command> ...` parses with the real command-line parser (serve, config, plan,
  convert) or the proxy's;
- every section (heading to heading) that states a measurement (a number with a unit of time,
  size, rate, a percentage or an `Nx` ratio) cites a `benchmarks/results/` file. A limit or
  default written next to the key or constant that holds it (`lease_s`, default 60 s) is not a
  measurement; a section whose numbers are not measurements at all (compiler output, arithmetic)
  says so with `<!-- not-measured: reason -->`, and such markers stay few.
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


# A measurement: a number followed by a unit of time, size or rate, a percentage, or a ratio
# written `1.86x` / `4×` (no space: `2x4` topologies, `16 x 128` shapes and versions never match).
_NUMBER = r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?"
_MEASUREMENT = re.compile(
    _NUMBER
    + r"(?:\s?(?:tok/s|tokens/s|req/s|requests/s|[TGM]FLOP/s|[TGMK]B/s|[TGM]FLOP|ms|us|µs|GiB|MiB|KiB|GB|MB|KB|%)(?![\w/])"
    r"|\s(?:s|min|minutes|seconds|hours)\b"
    r"|[x×](?!\w))"
)
# ... unless it is a setting: right after the config key (`server.drain_timeout_s`, `lease_s`),
# flag (`--idle-timeout`) or constant (`SEND_TIMEOUT_S`) that holds it, or after "default" / "≤".
_SETTING = re.compile(
    r"(?:`(?:[a-z][a-z0-9]*(?:[._][a-z0-9]+)+|--[a-z][a-z-]*|[A-Z][A-Z0-9_]+)`\)?\s*[(,:=]\s*(?:default:?\s*)?"
    r"|\bdefault:?\s+(?:is\s+)?|≤\s*|<=\s*)~?$"
)
_OPT_OUT = re.compile(r"<!-- not-measured: (.*?) -->")
MAX_OPT_OUTS = 6


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) for each heading-to-heading section; `#` lines inside fenced blocks
    (shell comments) are not headings."""
    sections, heading, body, fenced = [], "(top)", [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            sections.append((heading, "\n".join(body)))
            heading, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    sections.append((heading, "\n".join(body)))
    return sections


def measurements(body: str) -> list[str]:
    body = _OPT_OUT.sub("", body)
    return [
        m.group(0) for m in _MEASUREMENT.finditer(body) if not _SETTING.search(body[max(0, m.start() - 60) : m.start()])
    ]


def unsupported_measurements(text: str) -> list[str]:
    """Sections that state measurements but cite no result file (and are not marked)."""
    return [
        f"## {heading}: {found[:5]}"
        for heading, body in _sections(text)
        if (found := measurements(body)) and not _RESULT.search(body) and not _OPT_OUT.search(body)
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_measured_numbers_cite_a_result_file(page):
    unsupported = unsupported_measurements(page.read_text())
    assert not unsupported, (
        f"{page.name}: sections with measured numbers and no benchmarks/results/ file in them "
        f"(cite the file the numbers come from, or remove them): {unsupported}"
    )


def test_the_measurement_check_has_teeth():
    cited = "benchmarks/results/cpu-2core-r12/saturation.json"
    assert unsupported_measurements("# P\n\n## Speed\n\nIt serves 1234 tok/s, 1.5x vLLM.\n")
    assert unsupported_measurements("## Table\n\n| case | p99 |\n|---|---|\n| a | 13.5 ms |\n")
    assert unsupported_measurements("## Run\n\n```\nrun  # took 22 min\n```\n")
    assert unsupported_measurements("## A/B\n\n`ours-bf16` (1469 tok/s) vs `vllm` (788 tok/s)\n")
    assert not unsupported_measurements(f"## Speed\n\nIt serves 1234 tok/s (`{cited}`).\n")
    # a number in another section does not count as cited
    assert unsupported_measurements(f"## A\n\n`{cited}`\n\n## B\n\n3.2 ms a step.\n")
    for not_a_measurement in (
        "jax 0.10.2, vLLM 0.32.0, torch 2.13.0+cpu",
        "a v5e 2x4 slice, [16 x 128] tiles, HTTP 400s, `top_k: 2147483648`",
        "held under a lease (`lease_s`, default 60 s); bodies ≤ 64 KiB; `SEND_TIMEOUT_S` (30 s)",
        "<!-- not-measured: compiler output -->\nweights 16.68 GiB",
    ):
        assert not unsupported_measurements(f"## S\n\n{not_a_measurement}\n"), not_a_measurement


def test_opt_outs_are_rare_and_say_why():
    markers = []
    for page in PAGES:
        for heading, body in _sections(page.read_text()):
            for reason in _OPT_OUT.findall(body):
                markers.append(f"{page.name} ## {heading}")
                assert len(reason.split()) >= 5, f"{page.name} ## {heading}: say why these are not measurements"
                assert _MEASUREMENT.search(_OPT_OUT.sub("", body)), f"{page.name} ## {heading}: a stale marker"
    assert len(markers) <= MAX_OPT_OUTS, f"opt-outs are for the rare section of non-measurements: {markers}"
