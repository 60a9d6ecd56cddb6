"""Benchmark scripts: offline throughput, online serving load, peers (not part of the installed package)."""

import json
from pathlib import Path


def write_json(path: Path | None, report, indent: int = 2) -> None:
    """The scripts' `--json PATH`: the report as JSON (parent directories made); None: nothing."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent, default=str))
