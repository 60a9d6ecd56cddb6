"""The real BFCL evaluator (`bfcl-eval` from PyPI) against a running jaxserve server.

Runs in its own venv (bfcl-eval pins numpy, networkx and filelock below the project's), as a
plain HTTP client; `benchmarks/bfcl_eval_run.sh` makes the venv, starts the server and calls:

    .bfcl-venv/bin/python benchmarks/bfcl_eval_driver.py --url http://127.0.0.1:8000 \
        --categories simple_python,multiple,parallel --limit 50 --json out.json

(Not `benchmarks/bfcl_eval.py`: run as a script, that name would shadow the `bfcl_eval` package.)

bfcl's OpenAI-compatible function-calling handler (`OpenAICompletionsHandler`, what its
`gpt-*-FC` Chat Completions entries use) sends `tools` and no `tool_choice`, so a server reads
`auto` and a small model may answer in prose. This script registers a model entry,
`jaxserve-FC`, whose handler is that class with `tool_choice: "required"` added (the server
then generates the calls with its grammar) and a `max_tokens` bound; `parallel_tool_calls`
is left unset (the OpenAI default, true: the grammar allows 1 to `--max-tool-calls` calls, the
model chooses how many). A second entry, `jaxserve-FC-single`, also sends
`parallel_tool_calls: false` (exactly one call) and is run on the single-call categories.
Everything else is bfcl's own: its datasets (shipped in the wheel), its tool conversion (`.`
in names becomes `_`, BFCL types become JSON schema types), its `bfcl generate` and
`bfcl evaluate` (the AST checker), run in this process so the entries are known to both. The
first `--limit` entries of each category are run (bfcl's `--run-ids` file), evaluated with
`--partial-eval`.

Besides bfcl's accuracy, every emitted call is checked here: its arguments parse as JSON and
validate (`jsonschema`) against the schema the server was sent, and its name is one of the
entry's functions. Answers without a call are counted apart (`max_tokens` cut the only call).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from collections import Counter
from pathlib import Path

# bfcl model keys; no "_" (bfcl maps "_" back to "/" in result folder names)
MODEL_KEY = "jaxserve-FC"  # parallel_tool_calls unset (OpenAI default: true)
SINGLE_KEY = "jaxserve-FC-single"  # parallel_tool_calls: false


def _served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def register(key: str, model_id: str, max_tokens: int, parallel_tool_calls: bool | None) -> None:
    """Add `key` to bfcl's model table: its Chat Completions FC handler, calls forced."""
    from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
    from bfcl_eval.model_handler.api_inference.openai_completion import (
        OpenAICompletionsHandler,
    )

    class JaxserveFCHandler(OpenAICompletionsHandler):
        def _query_FC(self, inference_data: dict):
            message = inference_data["message"]
            tools = inference_data["tools"]
            inference_data["inference_input_log"] = {"message": repr(message), "tools": tools}
            kwargs = {
                "messages": message,
                "model": self.model_name,
                "temperature": self.temperature,
                "store": False,
                "max_tokens": max_tokens,
            }
            if tools:
                kwargs["tools"] = tools
                kwargs["tool_choice"] = "required"
                if parallel_tool_calls is not None:
                    kwargs["parallel_tool_calls"] = parallel_tool_calls
            return self.generate_with_backoff(**kwargs)

    MODEL_CONFIG_MAPPING[key] = ModelConfig(
        model_name=model_id,
        display_name=f"{model_id} (jaxserve, FC, forced)",
        url="https://github.com/",
        org="jaxserve",
        license="",
        model_handler=JaxserveFCHandler,
        is_fc_model=True,
        underscore_to_dot=True,
    )


def _bfcl(args: list[str]) -> None:
    from bfcl_eval.__main__ import cli

    print("+ bfcl " + " ".join(args), flush=True)
    cli(args, standalone_mode=False)


def check_calls(result_dir: Path, key: str, categories: list[str], max_tokens: int) -> dict:
    """Every emitted call: JSON arguments, valid against the schema sent, a known name."""
    import jsonschema
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import load_dataset_entry

    out = {}
    for category in categories:
        entries = {e["id"]: e for e in load_dataset_entry(category)}
        files = list((result_dir / key).rglob(f"BFCL_v4_{category}_result.json"))
        rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
        stats = {
            "entries": len(rows),
            "calls": 0,
            "valid_calls": 0,
            "answers_without_call": 0,
            "answers_cut_by_max_tokens": 0,
            "errors": 0,
            "invalid": [],
        }
        for row in rows:
            result = row["result"]
            if row.get("output_token_count", 0) >= max_tokens:
                stats["answers_cut_by_max_tokens"] += 1
            if isinstance(result, str) and result.startswith("Error during inference"):
                stats["errors"] += 1
                continue
            if not isinstance(result, list) or not result:
                stats["answers_without_call"] += 1
                continue
            tools = convert_to_tool(entries[row["id"]]["function"], GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            for call in result:
                stats["calls"] += 1
                ((name, arguments),) = call.items()
                try:
                    if name not in schemas:
                        raise ValueError(f"unknown function {name!r}")
                    jsonschema.validate(json.loads(arguments), schemas[name])
                except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
                    stats["invalid"].append({"id": row["id"], "call": call, "error": str(e)[:300]})
                else:
                    stats["valid_calls"] += 1
        stats["valid_share"] = stats["valid_calls"] / stats["calls"] if stats["calls"] else None
        out[category] = stats
    return out


def read_scores(score_dir: Path, key: str, categories: list[str]) -> dict:
    """bfcl's per-category score files: the first line is {accuracy, correct_count, total_count}."""
    scores = {}
    for category in categories:
        for f in (score_dir / key).rglob(f"BFCL_v4_{category}_score.json"):
            lines = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            head = lines[0]
            scores[category] = {k: head[k] for k in ("accuracy", "correct_count", "total_count") if k in head}
            scores[category]["error_types"] = dict(Counter(e.get("error_type", "?") for e in lines[1:]))
    return scores


def run(key: str, categories: list[str], ids: dict, args) -> dict:
    """bfcl generate + evaluate for one model entry on `ids` (category -> entry ids)."""
    from bfcl_eval.constants.eval_config import (
        RESULT_PATH,
        SCORE_PATH,
        TEST_IDS_TO_GENERATE_PATH,
    )

    TEST_IDS_TO_GENERATE_PATH.write_text(json.dumps({c: ids[c] for c in categories}, indent=1))
    t0 = time.time()
    _bfcl(
        [
            "generate",
            "--model",
            key,
            "--run-ids",
            "--allow-overwrite",
            "--num-threads",
            str(args.num_threads),
            "--temperature",
            "0",
        ]
    )
    generate_s = time.time() - t0
    _bfcl(["evaluate", "--model", key, "--test-category", ",".join(categories), "--partial-eval"])
    scores = read_scores(SCORE_PATH, key, categories)
    calls = check_calls(RESULT_PATH, key, categories, args.max_tokens)
    total = sum(s["calls"] for s in calls.values())
    valid = sum(s["valid_calls"] for s in calls.values())
    return {
        "entries_per_category": {c: len(ids[c]) for c in categories},
        "generate_s": round(generate_s, 1),
        "accuracy": scores,
        "calls": calls,
        "calls_total": total,
        "calls_valid": valid,
        "valid_share": valid / total if total else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--categories", default="simple_python,multiple,parallel")
    parser.add_argument("--limit", type=int, default=50, help="first N entries per category (0: all)")
    parser.add_argument(
        "--single-call-categories",
        default="simple_python,multiple",
        help="also run these with parallel_tool_calls: false ('' to skip)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=4, help="concurrent requests")
    parser.add_argument("--workdir", type=Path, required=True, help="BFCL_PROJECT_ROOT (results, scores)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()

    url = args.url.rstrip("/")
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    single = [c.strip() for c in args.single_call_categories.split(",") if c.strip()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    # bfcl reads these at import time.
    os.environ["BFCL_PROJECT_ROOT"] = str(args.workdir.resolve())
    os.environ["OPENAI_BASE_URL"] = f"{url}/v1"
    os.environ.setdefault("OPENAI_API_KEY", "EMPTY")

    model_id = _served_model(url)
    register(MODEL_KEY, model_id, args.max_tokens, None)
    register(SINGLE_KEY, model_id, args.max_tokens, False)
    from bfcl_eval.utils import load_dataset_entry

    ids = {c: [e["id"] for e in load_dataset_entry(c)] for c in dict.fromkeys(categories + single)}
    if args.limit:
        ids = {c: v[: args.limit] for c, v in ids.items()}

    import importlib.metadata as md

    report = {
        "bfcl_eval_version": md.version("bfcl-eval"),
        "model": model_id,
        "url": url,
        "handler": "bfcl's OpenAICompletionsHandler (Chat Completions, FC) with tool_choice='required' "
        f"and max_tokens={args.max_tokens} added",
        "temperature": 0,
        "limit_per_category": args.limit,
        "num_threads": args.num_threads,
        "runs": {},
    }
    report["runs"]["parallel_tool_calls unset (true)"] = run(MODEL_KEY, categories, ids, args)
    if single:
        report["runs"]["parallel_tool_calls false"] = run(SINGLE_KEY, single, ids, args)
    summary = {
        name: {
            c: {
                "accuracy": r["accuracy"].get(c, {}).get("accuracy"),
                "calls": r["calls"][c]["calls"],
                "valid": r["calls"][c]["valid_calls"],
                "without_call": r["calls"][c]["answers_without_call"],
            }
            for c in r["calls"]
        }
        | {"valid_share": r["valid_share"]}
        for name, r in report["runs"].items()
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
