"""Gemma 4's image path (issue 64): each image token's id travels beside its features to the per-layer embeddings,
which look up the pad token's row for it as transformers does; our decoder against transformers for every way a
prompt's text and image can be split into calls; what the processor's budget and model.image_size make of the one
square a program takes; what is refused. The program itself (vision encoder parity, the stock MultimodalRunner's
greedy tokens, exporters.generate) is tests/test_vision_language.py's, which runs this family with the others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from exporters.errors import UserError
from exporters.export import checked_config
from exporters.program.vision import program_pixels
from models.checkpoint import build_model, open_checkpoint
from models.decoder import id_digits, ids_of_digits
from models.errors import ModelError
from models.vision_encoder import load_vision_encoder
from tests.helpers import assert_every_split_matches, compose_config, sized_run, transformers_model


def picture(height: int = 40, width: int = 50):  # type: ignore[no-untyped-def]
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(height, width, 3) * 255).astype("uint8"))


def test_an_image_prompt_gets_transformers_logits_however_it_is_split_into_calls(vlm_checkpoint) -> None:
    """Text, the processor's image (begin, 4 image tokens, end), text: every position's logits equal transformers' one
    forward when the runner's three calls feed it, when one call does, when the image is cut between two calls; then
    a decoded token by id. The tiny checkpoint's pad row of the per-layer table is not zero, so this fails if an
    image token's per-layer embedding is looked up by the image id (or left out), as the last check shows."""
    from models.vision import load_processor

    ckpt = vlm_checkpoint("gemma4")
    ref, ours = transformers_model(ckpt), build_model(open_checkpoint(ckpt), 32).eval()
    config = ref.config
    assert ref.model.language_model.embed_tokens_per_layer.weight[config.text_config.pad_token_id].abs().sum() > 0
    encoder = load_vision_encoder(str(ckpt), config)
    inputs = load_processor(ckpt)(images=picture(), text="Once upon <|image|> a time", return_tensors="pt")
    ids = inputs["input_ids"]
    first = int((ids[0] == config.image_token_id).nonzero()[0])
    n = int((ids[0] == config.image_token_id).sum())
    assert n == encoder.tokens and int(ids[0, first - 1]) == config.boi_token_id
    with torch.no_grad():
        expected = ref(**{k: v for k, v in inputs.items() if k != "num_soft_tokens_per_image"}).logits[0]
        image = encoder(program_pixels(inputs, encoder.image_size))
        with ours.returns_token_embeddings():
            before, after = ours(ids[:, :first]), ours(ids[:, first + n:])
        splits = {"the runner's three calls": [before, image, after],
                  "one call": [torch.cat([before, image, after], 1)],
                  "an image over two calls": [torch.cat([before, image[:, :2]], 1),
                                              torch.cat([image[:, 2:], after], 1)]}
        # Soft-capped logits of up to 10: float rounding of sums in another order (a call's window) reaches 1e-5
        assert_every_split_matches(ours, splits, expected, atol=5e-5)
        token = int(expected[-1].argmax())
        longer = {**inputs, "input_ids": torch.cat([ids, torch.tensor([[token]])], 1),
                  "mm_token_type_ids": torch.cat([inputs["mm_token_type_ids"], torch.tensor([[0]])], 1),
                  "attention_mask": torch.ones(1, ids.shape[1] + 1, dtype=torch.int64)}
        after_one = ref(**{k: v for k, v in longer.items() if k != "num_soft_tokens_per_image"}).logits[0, -1]
        torch.testing.assert_close(ours(torch.tensor([[token]]), torch.tensor([ids.shape[1]]))[0], after_one,
                                   atol=5e-5, rtol=0)
        # The same features carrying another token's id: the per-layer embeddings read the id channels.
        other = image.clone()
        other[..., -3:] = id_digits(torch.full((1, n), 5), other.dtype)
        ours.reset_cache()
        moved = ours(torch.cat([before, other, after], 1), torch.tensor([0]), True)[0]
        assert (moved[first:] - expected[first:]).abs().max() > 1e-3


def test_token_ids_travel_exactly_in_every_activation_dtype() -> None:
    """A 262144-token vocabulary's ids in bf16 would be rounded to 256s; as three base-256 digits they are whole
    numbers each dtype holds, and come back exactly."""
    ids = torch.tensor([[0, 1, 255, 256, 257, 65535, 65536, 258880, 262143]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        digits = id_digits(ids, dtype)
        assert digits.dtype == dtype and digits.shape == (1, 9, 3)
        assert torch.equal(ids_of_digits(digits), ids)


def _budgeted(tmp_path: Path, max_soft_tokens: int, **fields: object) -> Path:
    """A folder with a hub-shaped Gemma 4 config (16 px patches pooled 3 x 3) and a processor of that budget."""
    from transformers import Gemma4Config, Gemma4VisionConfig

    folder = tmp_path / f"processor-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    Gemma4Config(vision_config=Gemma4VisionConfig(),
                 architectures=["Gemma4ForConditionalGeneration"]).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({
        "image_processor": {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": max_soft_tokens, **fields},
        "processor_class": "Gemma4Processor"}))
    return folder


def test_the_processor_budget_sets_the_square_and_model_image_size_another(tmp_path: Path) -> None:
    """transformers' processor keeps a picture's aspect ratio within max_soft_tokens positions; the program takes the
    largest square within it (70, 140, 280: 384, 528, 768 px), or model.image_size's (a multiple of patch x pool)."""
    from transformers import AutoConfig

    from models.vision import geometry_of

    for budget, side in ((70, 384), (140, 528), (280, 768)):
        folder = _budgeted(tmp_path, budget)
        config = AutoConfig.from_pretrained(folder)
        assert geometry_of(config, folder) == (side, (side // 48) ** 2)
    assert geometry_of(config, folder, 480) == (480, 100)
    # A published copy's stale size (SigLIP's 224 x 224, which transformers' processor ignores) cuts no whole cells:
    # ignored, as transformers ignores it; a run's own square is read.
    stale = _budgeted(tmp_path, 280, size={"height": 224, "width": 224})
    assert geometry_of(config, stale) == (768, 256)
    assert geometry_of(config, _budgeted(tmp_path, 280, size={"height": 480, "width": 480})) == (480, 100)
    with pytest.raises(ModelError, match=r"model.image_size=500: .* must be a multiple of 48"):
        geometry_of(config, folder, 500)


def test_model_image_size_sizes_the_run_s_processor(vlm_checkpoint, tmp_path: Path) -> None:
    """model.image_size=96 on the tiny checkpoint (8 px patches pooled 3 x 3): the plan's 96 x 96 square of 16
    positions, and the processor files the run keeps make that square."""
    from models.vision import load_processor

    ckpt = vlm_checkpoint("gemma4")
    run = tmp_path / "run"
    geometry = sized_run(ckpt, run, "model.image_size=96", "export.max_seq_len=64")
    assert (geometry.image_size, geometry.tokens) == (96, 16)
    assert json.loads((run / "processor_config.json").read_text())["image_processor"]["size"] == {"height": 96,
                                                                                                  "width": 96}
    made = load_processor(run)(images=picture(), text="a <|image|> b", return_tensors="pt")
    assert program_pixels(made, 96).shape == (1, 3, 96, 96)
    assert int((made["input_ids"] == geometry.image_token_id).sum()) == 16
    with pytest.raises(ModelError, match="model.image_size=50: .* multiple of 24"):
        checked_config(compose_config("model=hf", f"model.checkpoint={ckpt}", "model.image_size=50"))
    # An image token carries the same id at every place (not Qwen-VL's places): bf16 holds it beyond 256 positions.
    checked_config(compose_config("model=hf", f"model.checkpoint={ckpt}", "model.image_size=408", "quant=bf16",
                                  "export.max_seq_len=320"))


def test_rows_with_padding_fold_back_into_the_pixels_and_another_grid_is_refused() -> None:
    """The processor's patch rows (channel fastest), padded to its budget with rows at (-1, -1), become the
    [1, 3, S, S] vision_encoder takes, exactly; rows of a grid other than the program's square are refused."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import (convert_image_to_patches,
                                                                        pad_along_first_dim)

    pixels = torch.rand(1, 3, 48, 48)
    rows = convert_image_to_patches(pixels[0].numpy(), 8)
    xs, ys = np.meshgrid(np.arange(6), np.arange(6), indexing="xy")
    rows, positions = pad_along_first_dim(rows, np.stack([xs, ys], -1).reshape(-1, 2), 630)
    made = {"pixel_values": torch.from_numpy(rows)[None], "image_position_ids": torch.from_numpy(positions)[None]}
    assert torch.equal(program_pixels(made, 48), pixels)
    with pytest.raises(UserError, match="made a 48x48 image and the program's vision_encoder takes 96x96"):
        program_pixels(made, 96)


@pytest.mark.parametrize("attention", ["aten", "custom_ops"])
def test_a_config_attending_both_ways_within_images_gets_transformers_logits(vlm_checkpoint, tmp_path: Path,
                                                                            attention: str) -> None:
    """use_bidirectional_attention="vision" (the larger Gemma 4 configs): within a run of image tokens the sliding
    layers attend both ways (full-attention layers stay causal), found from the ids the embeddings carry. transformers'
    logits when the runner's three calls feed the prompt (the image whole in one) and when one call does, with either
    attention; the causal model's differ, so the test sees the difference. The plan exports the image path."""
    from exporters.components.resolve import plan_export
    from models.vision import load_processor

    ckpt = shutil.copytree(vlm_checkpoint("gemma4"), tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (ckpt / "config.json").write_text(json.dumps(config))
    ref, ours = transformers_model(ckpt), build_model(open_checkpoint(ckpt), 32, attention=attention).eval()
    assert ours.args.attention == attention and ours.args.layer_bidirectional == (True, False, True, False)
    encoder = load_vision_encoder(str(ckpt), ref.config)
    inputs = load_processor(ckpt)(images=picture(), text="Once upon <|image|> a time", return_tensors="pt")
    ids = inputs["input_ids"]
    where = (ids[0] == ref.config.image_token_id).nonzero()[:, 0]
    first, n = int(where[0]), len(where)
    given = {k: v for k, v in inputs.items() if k != "num_soft_tokens_per_image"}
    with torch.no_grad():
        expected = ref(**given).logits[0]
        causal = transformers_model(vlm_checkpoint("gemma4"))(**given).logits[0]
        assert (causal[first:first + n] - expected[first:first + n]).abs().max() > 1e-3
        image = encoder(program_pixels(inputs, encoder.image_size))
        with ours.returns_token_embeddings():
            before, after = ours(ids[:, :first]), ours(ids[:, first + n:])
        splits = {"the runner's three calls": [before, image, after], "one call": [torch.cat([before, image, after], 1)]}
        assert_every_split_matches(ours, splits, expected, atol=5e-5)
    plan = plan_export(compose_config("model=hf", f"model.checkpoint={ckpt}", "export.max_seq_len=32"))
    assert [c.name for c in plan.components] == ["decoder", "vision"]
