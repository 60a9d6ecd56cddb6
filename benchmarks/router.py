"""`jaxserve router` on loopback: prefix affinity vs round robin vs one instance, overhead, a kill.

    python -m benchmarks.router [--family qwen3_5] [--conversations 9] [--turns 3] [--json out.json]

Starts 4 replicas of a tiny hybrid (`jaxserve serve`, a shared persistent compile cache so later
replicas load what the first compiled) and `jaxserve router` processes in front of them, then:
  trace       a multi-turn chat trace (conversations over a few shared system prompts; turn k of
              every conversation is sent concurrently, then turn k+1 with the answers appended),
              through cache_aware and round_robin routers over 2 and over 4 replicas, and sent
              straight to one instance: cached-token share (sum of the replicas' own
              usage.prompt_tokens_details.cached_tokens / prompt tokens) and TTFT p50/p90.
              Each run salts its system prompts, so no run hits another's cache.
  overhead    sequential streamed requests (unique prompts) alternating direct to one replica and
              through a one-backend router: TTFT and ITL medians.
  kill        streams through a router over 2 replicas; one replica is SIGKILLed mid-run, more
              requests follow, then it is restarted on its port: how each request ended, and how
              long the router took to notice the return.
The conversations count is odd so round robin does not land a conversation on one replica by
accident. The machine this was written on has 2 cores shared with other jobs: runs are small and
absolute times are noisy; compare runs of one invocation only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from benchmarks.pd_cluster import BASE_FLAGS, Process

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PROMPTS = (
    "You are a careful assistant for a travel agency. Answer briefly and politely, with one fact. ",
    "You are a terse code reviewer. Point at the single most important problem in what you read. ",
    "You are a librarian who recommends one book per question and says why in a sentence. ",
)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def stream_chat(session: aiohttp.ClientSession, url: str, messages: list, max_tokens: int, extra=None) -> dict:
    """One streamed chat request: TTFT, inter-token gaps, usage, the text, how it ended."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start, first, last, gaps, text, usage, error, done = time.perf_counter(), None, None, [], "", None, None, False
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                body = (await resp.text())[:200]
                return {"status": resp.status, "ok": False, "error": body, "streamed": False, "done": False}
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = event.decode().removeprefix("data: ")
                    if data == "[DONE]":
                        done = True
                        continue
                    payload = json.loads(data)
                    if "error" in payload:
                        error = payload["error"]["message"]
                        continue
                    if payload.get("usage"):
                        usage = payload["usage"]
                    for choice in payload.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            now = time.perf_counter()
                            if first is None:
                                first = now
                            else:
                                gaps.append(now - last)
                            last, text = now, text + piece
    except (aiohttp.ClientError, TimeoutError) as err:
        return {"status": None, "ok": False, "error": repr(err), "streamed": first is not None, "done": done}
    return {
        "status": 200,
        "ok": error is None and usage is not None and done,
        "done": done,
        "error": error,
        "streamed": first is not None,
        "ttft_s": None if first is None else first - start,
        "gaps_s": gaps,
        "usage": usage,
        "text": text,
    }


def conversations(salt: str, count: int) -> list[list[dict]]:
    return [
        [{"role": "system", "content": f"[{salt}] {SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]}"}] for i in range(count)
    ]


async def run_trace(url: str, salt: str, count: int, turns: int, max_tokens: int) -> dict:
    histories, results = conversations(salt, count), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        for turn in range(turns):
            for i, history in enumerate(histories):
                history.append(
                    {"role": "user", "content": f"Conversation {i}, question {turn}: what about item {i * 7 + turn}?"}
                )
            answers = await asyncio.gather(*(stream_chat(session, url, h, max_tokens) for h in histories))
            for history, answer in zip(histories, answers):
                history.append({"role": "assistant", "content": answer.get("text") or "ok"})
                results.append({**answer, "turn": turn})
    ok = [r for r in results if r["ok"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
    later = [r for r in ok if r["turn"] > 0]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "requests": len(results),
        "ok": len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else None,
        "cached_share_turns_after_first": (
            sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in later)
            / max(1, sum(r["usage"]["prompt_tokens"] for r in later))
        ),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
    }


def router_metrics(url: str) -> dict:
    """The router's /metrics, labelled samples included."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in lines if line.startswith("jaxserve_")}


def start_replica(name: str, path: Path, cache_dir: str, port: int = 0) -> Process:
    flags = [*BASE_FLAGS, "--set", f"compile.cache_dir={cache_dir}", "--set", f"server.port={port}"]
    return Process(name, ["serve", str(path), *flags], timeout_s=600)


def start_router(name: str, backends: list[str], policy: str, tokenizer: Path, extra=()) -> Process:
    flags = [arg for url in backends for arg in ("--backend", url)]
    argv = ["router", *flags, "--policy", policy, "--tokenizer", str(tokenizer), "--port", "0", *extra]
    return Process(name, argv, timeout_s=120)


async def overhead(direct: str, routed: str, pairs: int, max_tokens: int) -> dict:
    samples: dict[str, dict[str, list]] = {"direct": {"ttft": [], "itl": []}, "router": {"ttft": [], "itl": []}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(pairs):
            for name, url in (
                (("direct", direct), ("router", routed)) if i % 2 == 0 else (("router", routed), ("direct", direct))
            ):
                messages = [{"role": "user", "content": f"overhead probe {name} {i}: count some numbers please"}]
                r = await stream_chat(session, url, messages, max_tokens)
                if r["ok"]:
                    samples[name]["ttft"].append(r["ttft_s"])
                    samples[name]["itl"].extend(r["gaps_s"])
    out = {}
    for name, s in samples.items():
        out[name] = {
            "requests": len(s["ttft"]),
            "ttft_p50_s": percentile(s["ttft"], 50),
            "itl_p50_s": percentile(s["itl"], 50),
            "itl_mean_s": statistics.fmean(s["itl"]) if s["itl"] else None,
        }
    return out


async def in_flight(session: aiohttp.ClientSession, router: str, backend: int) -> float:
    async with session.get(router + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(f'jaxserve_router_backend_in_flight{{backend="{backend}"}}'):
                return float(line.rpartition(" ")[2])
    return 0.0


async def kill_run(router: str, victim: Process, restart, streams: int, after: int, max_tokens: int) -> dict:
    """`streams` long streams (ignore_eos) through a 2-replica router; once backend 1 (the victim)
    is streaming, SIGKILL it, send `after` more requests, then restart it on its port."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        def messages(i):
            return [{"role": "user", "content": f"kill run request {i}: tell me a long story"}]

        def long_stream(i):
            body = {"ignore_eos": True}
            return stream_chat(session, router, messages(i), max_tokens, body)

        first_wave = [asyncio.create_task(long_stream(i)) for i in range(streams)]
        deadline = time.monotonic() + 300
        while await in_flight(session, router, 1) == 0:
            assert time.monotonic() < deadline, "no request reached the victim"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its streams have begun
        victim.kill()
        killed_at = time.monotonic()
        second_wave = await asyncio.gather(*(stream_chat(session, router, messages(100 + i), 8) for i in range(after)))
        first = await asyncio.gather(*first_wave)
    noticed_down = router_metrics(router)['jaxserve_router_backend_up{backend="1"}'] == 0
    restarted = restart()
    back_at, deadline = None, time.monotonic() + 120
    while time.monotonic() < deadline:
        if router_metrics(router)['jaxserve_router_backend_up{backend="1"}'] == 1:
            back_at = time.monotonic()
            break
        time.sleep(0.05)

    def outcome(r):
        if r["ok"]:
            return "completed"
        if r["status"] == 200 and r["error"] and r["streamed"]:
            return "cut mid-stream: error event + [DONE]"
        return f"failed: {r['status']} {r['error']}"

    tally: dict[str, int] = {}
    for r in first:
        tally["in flight: " + outcome(r)] = tally.get("in flight: " + outcome(r), 0) + 1
    for r in second_wave:
        tally["sent after the kill: " + outcome(r)] = tally.get("sent after the kill: " + outcome(r), 0) + 1
    return {
        "in_flight_at_kill": streams,
        "sent_after_kill": after,
        "outcomes": tally,
        "cut_streams_ended_with_done": all(r["done"] for r in first if r["streamed"] and r["error"]),
        "after_kill_all_ok": all(r["ok"] for r in second_wave),
        "router_noticed_down": noticed_down,
        "return_noticed_s_after_restart_ready": None if back_at is None else back_at - restarted,
        "kill_to_restart_ready_s": restarted - killed_at,
        "router_metrics": router_metrics(router),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--overhead-pairs", type=int, default=6)
    parser.add_argument("--json", default=str(ROOT / "benchmarks/results/router/router-cpu-2core.json"))
    args = parser.parse_args()
    from benchmarks.tiny_checkpoints import build_cached_checkpoint

    path = build_cached_checkpoint(args.family)
    cache_dir = tempfile.mkdtemp(prefix="router-bench-xla-")
    processes: list[Process] = []
    result = {"family": args.family, "conversations": args.conversations, "turns": args.turns, "runs": {}}
    result["machine"] = "2 CPU cores shared with other jobs; tiny random checkpoint; small runs, noisy times"
    try:
        replicas = []
        for i in range(4):
            replicas.append(start_replica(f"replica{i}", path, cache_dir))
            processes.append(replicas[-1])
        urls = [r.url for r in replicas]
        for url in urls:  # compile the buckets the trace uses before anything is timed
            asyncio.run(run_trace(url, f"warm-{url}", 4, args.turns, args.max_tokens))
        runs = result["runs"]
        runs["one_instance"] = asyncio.run(run_trace(urls[0], "one", args.conversations, args.turns, args.max_tokens))
        print(f"one instance: {json.dumps(runs['one_instance'])}", flush=True)
        for n in (2, 4):
            for policy in ("round_robin", "cache_aware"):
                router = start_router(f"router-{policy}-{n}", urls[:n], policy, path)
                processes.append(router)
                trace = asyncio.run(
                    run_trace(router.url, f"{policy}-{n}", args.conversations, args.turns, args.max_tokens)
                )
                trace["router_affinity_share"] = router_metrics(router.url).get("jaxserve_router_affinity_share")
                runs[f"{policy}_{n}_replicas"] = trace
                router.kill()
                print(f"{policy} x{n}: {json.dumps(trace)}", flush=True)
        single = start_router("router-overhead", urls[:1], "cache_aware", path)
        processes.append(single)
        result["overhead"] = asyncio.run(overhead(urls[0], single.url, args.overhead_pairs, 16))
        print(f"overhead: {json.dumps(result['overhead'])}", flush=True)
        kill_router = start_router("router-kill", urls[2:4], "least_load", path, ["--health-interval", "0.5"])
        processes.append(kill_router)
        victim_port = int(urls[3].rsplit(":", 1)[1])

        def restart() -> float:
            processes.append(start_replica("replica3-again", path, cache_dir, victim_port))
            return time.monotonic()

        result["kill"] = asyncio.run(kill_run(kill_router.url, replicas[3], restart, 8, 4, 440))
        print(f"kill: {json.dumps(result['kill'])}", flush=True)
    finally:
        for process in processes:
            process.kill()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["runs"], indent=2))


if __name__ == "__main__":
    main()
