"""Our server beside ``llama-server`` on the same model: tokens/s and time to first token, one client and several.

    python -m benchmarks.serve_peers outputs/smollm2 --gguf <SmolLM2 .gguf> --llama-server <llama.cpp>/bin/llama-server \
        --out docs/results/serve-peers-smollm2.json

Both servers answer the same chat requests through the official ``openai`` client on loopback, streamed, greedy,
``--max-tokens`` each: ours over the exported program (one request at a time, the others queued), llama-server over
the GGUF file as it is (its own defaults: continuous batching over its slots, this machine's threads). Measured per
server and per number of concurrent clients: the median time to the first streamed token, the median decode rate of
one request (its tokens after the first over the time after the first), and the aggregate rate (every client's
tokens over the wall time of the round). Each client asks a different question, so no prompt is a cached prefix of
another's. llama.cpp is not a dependency: build ``llama-server`` from llama-cpp-python's sdist as
docs/speculative.md says for its other examples (``ninja -C build llama-server``). Measure alone.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from benchmarks.server_process import serving

QUESTIONS = ["Tell me about lighthouses.", "How do bees make honey?", "Why is the sky blue?",
             "Describe a day at the beach.", "What do cats like to eat?", "How does a bicycle work?",
             "Write a short poem about rain.", "What is a good breakfast?"]


def one_request(client: Any, model: str, question: str, tokens: int) -> dict[str, float]:
    start, first, count = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first if first is not None else end
    return {"ttft_s": first - start, "tokens": count, "decode_tok_s": (count - 1) / (end - first) if count > 1 and
            end > first else float("nan"), "end": end, "start": start}


def round_of(client: Any, model: str, clients: int, tokens: int) -> dict[str, float]:
    results: list[dict[str, float]] = []
    threads = [threading.Thread(target=lambda q=q: results.append(one_request(client, model, q, tokens)))
               for q in QUESTIONS[:clients]]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"ttft_s": statistics.median(r["ttft_s"] for r in results),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in results),
            "aggregate_tok_s": sum(r["tokens"] for r in results) / wall, "tokens": sum(r["tokens"] for r in results)}


def measure(client: Any, model: str, concurrency: list[int], tokens: int, repeats: int) -> dict[str, Any]:
    round_of(client, model, 1, 8)  # warm-up
    out = {}
    for clients in concurrency:
        rounds = [round_of(client, model, clients, tokens) for _ in range(repeats)]
        out[str(clients)] = {key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}
        print(model, clients, out[str(clients)], flush=True)
    return out


@contextmanager
def llama_server(binary: Path, gguf: Path, context: int) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c",
                             str(context)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import openai

    concurrency = [int(c) for c in args.clients.split(",")]
    manifest = json.loads((args.run / "manifest.json").read_text())
    context = manifest["kv_cache"]["positions"]  # llama-server gets the program's cache length
    results: dict[str, Any] = {}
    with serving(args.run, args.out.with_suffix(".log"), f"max_queue={max(concurrency)}") as server:
        results["ours"] = measure(server.client(), args.run.name, concurrency, args.max_tokens, args.repeats)
    with llama_server(args.llama_server, args.gguf, context) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        results["llama-server"] = measure(client, "model", concurrency, args.max_tokens, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"program": args.run.name, "gguf": args.gguf.name, "max_tokens": args.max_tokens,
                                    "repeats": args.repeats, "quantization": manifest["quantization"]["linear"]["scheme"],
                                    "servers": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
