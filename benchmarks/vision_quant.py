"""What each ``quant.vision`` scheme does to a vision encoder's image embeddings, eagerly, on a published shape.

    python -m benchmarks.vision_quant smolvlm-256m lfm2-vl-450m [--results docs/results/vision-quant.json]

For each shape (``benchmarks.vision_shapes``, seeded random weights: no vision-language weights ship in a package we
found), the fp32 encoder's embeddings of two images (the validation's seeded uniform pixels, and a smooth one: a
blurred, upsampled noise field, closer to a photograph's spectrum) against each scheme's (``quantize_vision``, as an
export applies it): the least and the mean cosine of one position's embedding, and the relative error of the whole.
Random weights have none of a trained tower's outlier channels, so these bound the rounding alone; the export's own
report (``check.unquantized`` in the manifest) measures it on real weights. One JSON line per shape.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.vision_shapes import SHAPES, write_shape


def smooth_image(size: int, seed: int = 0) -> torch.Tensor:
    """[1, 3, size, size] in [-1, 1]: noise on a 1/16 grid, upsampled bicubically (large smooth regions, edges)."""
    coarse = torch.rand(1, 3, max(size // 16, 2), max(size // 16, 2), generator=torch.Generator().manual_seed(seed))
    return (torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
            .clamp(0, 1) * 2 - 1)


def measure(shape: str) -> dict[str, object]:
    from exporters.quant.vision import VISION_SCHEMES, quantize_vision
    from exporters.validation.image import test_image
    from models.checkpoint import open_checkpoint
    from models.vision_encoder import random_vision_encoder

    with tempfile.TemporaryDirectory() as folder:
        config = open_checkpoint(write_shape(shape, Path(folder) / shape), need_weights=False).hf_config
    reference = random_vision_encoder(config, seed=0)
    images = {"uniform": test_image(reference.image_size), "smooth": smooth_image(reference.image_size)}
    with torch.no_grad():
        expected = {name: reference(pixels) for name, pixels in images.items()}
    rows = []
    for scheme in VISION_SCHEMES:
        encoder = copy.deepcopy(reference)
        quantize_vision(encoder, scheme, 32, torch.float32)
        row: dict[str, object] = {"scheme": scheme}
        with torch.no_grad():
            for name, pixels in images.items():
                start = time.perf_counter()
                got = encoder(pixels)
                seconds = time.perf_counter() - start
                cosine = torch.nn.functional.cosine_similarity(got[0], expected[name][0], dim=-1)
                error = float((got - expected[name]).norm() / expected[name].norm())
                row[name] = {"least_cosine": round(float(cosine.min()), 5), "mean_cosine": round(float(cosine.mean()), 6),
                             "relative_error": round(error, 5), "eager_s": round(seconds, 2)}
        rows.append(row)
        del encoder
    return {"shape": shape, "image_size": reference.image_size, "positions": reference.tokens,
            "encoder_params_m": round(sum(p.numel() for p in reference.parameters()) / 1e6, 2), "schemes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--results", type=Path, help="also write the lines to this JSON file")
    args = parser.parse_args()
    results = []
    for shape in args.shapes:
        results.append(measure(shape))
        print(json.dumps(results[-1]), flush=True)
    if args.results:
        args.results.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
