"""The image path of a vision-language program, in the ExecuTorch runtime: what an app pays for one picture.

    python -m benchmarks.vision <run folder or .pte> [--text-tokens 16] [--steps 64] [--repeats 5]

On one loaded program: RSS after load, ``vision_encoder`` on one image (ms), a prompt with one image (text, the
image, text: the MultimodalRunner's calls) in tokens per second of the whole prompt, and decode through
``decode_one_token`` (else ``token_embedding`` then ``text_decoder``). Medians after a warm-up; one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from exporters.program.vision import VISION_METHOD
from exporters.runtime.driver import Driver, MethodRoles, program_method_shapes
from exporters.runtime.generator import resolve_program
from exporters.runtime.media import MediaPrompt, prefill_parts
from exporters.runtime.memory import current_rss_mb
from exporters.runtime.programs import LoadedProgram
from exporters.validation.image import test_image


def median_seconds(run, repeats: int) -> float:  # type: ignore[no-untyped-def]
    run()  # warm-up: XNNPACK packs and allocates on the first call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(program: str, text_tokens: int, steps: int, repeats: int) -> dict[str, float]:
    pte = resolve_program(program)
    before = current_rss_mb()
    loaded = LoadedProgram(pte)
    shapes = program_method_shapes(loaded)
    mm = MethodRoles.through_embeddings(shapes)
    driver = Driver.of(loaded)
    loaded.load(VISION_METHOD, *(m for m in (mm.prompt, mm.embed, driver.roles.step) if m))
    after_load = current_rss_mb()
    size = int(loaded.constant("get_image_size"))
    per_image = int(loaded.constant("get_image_tokens"))
    vocab = int(loaded.constant("get_vocab_size"))
    pixels = test_image(size)
    text = torch.arange(3, 3 + 2 * text_tokens).remainder(vocab).reshape(1, -1)
    parts = [text[:, :text_tokens], pixels, text[:, text_tokens:]]
    prompt_len = 2 * text_tokens + per_image
    room = int(loaded.constant("get_max_context_len")) - prompt_len
    if room < 1:
        raise SystemExit(f"{pte}: its cache holds {room + prompt_len} positions and the prompt takes {prompt_len} "
                         f"(2 x --text-tokens {text_tokens} and the image's {per_image}): no room to decode. Give a "
                         "smaller --text-tokens, or export with a larger export.max_seq_len.")
    steps = min(steps, room)  # what the cache holds after it
    encode_s = median_seconds(lambda: loaded.run(VISION_METHOD, pixels), repeats)
    prompt_s = median_seconds(lambda: prefill_parts(loaded, mm, MediaPrompt.of([], parts, VISION_METHOD)), repeats)

    def decode() -> None:
        for i in range(steps):
            driver.decode_one_token(7 + i % 100, prompt_len + i)

    decode_s = median_seconds(decode, repeats)
    return {"rss_after_load_mb": round(after_load - before, 1), "image_encode_ms": round(encode_s * 1e3, 1),
            "image_positions": per_image, "image_size": size, "prompt_tokens": prompt_len,
            "prompt_with_image_tok_s": round(prompt_len / prompt_s, 1), "decode_tok_s": round(steps / decode_s, 1),
            "decode_method": driver.roles.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", help="a run folder or .pte of a vision-language export")
    parser.add_argument("--text-tokens", type=int, default=16, help="text tokens before the image, and after it")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--report", type=Path, help="also write the export's cost (its manifest) with these numbers "
                                                    "here, as the vision_shape table of docs reads it")
    parser.add_argument("--shape", help="the shape's name in the report (benchmarks.vision_shapes)")
    args = parser.parse_args()
    runtime = measure(args.program, args.text_tokens, args.steps, args.repeats)
    print(json.dumps(runtime))
    if args.report is not None:
        args.report.write_text(json.dumps(report(args.program, args.shape, runtime), indent=2) + "\n")


def report(program: str, shape: str | None, runtime: dict[str, float]) -> dict[str, Any]:
    """The export's cost from the run's manifest (wall, peak and estimate, program size, stages, its settings) beside
    the runtime's numbers."""
    run = resolve_program(program).parent
    m = json.loads((run / "manifest.json").read_text())
    r = m["resources"]
    vision = m["components"]["vision"]["vision"]
    quant = m["config"]["quant"]
    settings = [f"quant={quant['name']}", f"quant.vision={quant['vision']}",
                f"export.max_seq_len={m['config']['export']['max_seq_len']}"]
    return {"shape": shape or run.name, "settings": settings, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"],
            "estimated_peak_rss_mb": r["estimated_peak_rss_mb"],
            "program_mb": round(m["program"]["size_bytes"] / 1e6, 1), "stages_s": m["timings_s"],
            "partitions": {name: method["delegated_partitions"] for name, method in m["methods"].items()},
            "validation": ({"passed": m["validation"]["passed"], "encoder_cosine": vision["check"]["cosine"]}
                           if m.get("validation") and vision.get("check") else None),  # None: validate=false
            "runtime": runtime}


if __name__ == "__main__":
    main()
