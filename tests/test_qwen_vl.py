"""Qwen2.5-VL and Qwen3-VL: M-RoPE positions and deepstack features in our decoder against transformers, for every way
a prompt's text and image can be split into calls; what a program of one square image refuses. The programs
themselves (vision encoder parity, the stock MultimodalRunner's greedy tokens, exporters.generate) are
tests/test_vision_language.py's, which runs these families with the others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from exporters.export import checked_config
from exporters.errors import UserError
from exporters.program.vision import program_pixels
from models.checkpoint import build_model, open_checkpoint
from models.decoder import DecoderArgs, RopeTable
from models.errors import ModelError
from tests.helpers import assert_every_split_matches, compose_config, sized_run, transformers_model

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
TEXT_BEFORE, TEXT_AFTER = [10, 11], [12, 13, 14]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_of_any_grid_gets_transformers_positions_however_the_prompt_is_split_into_calls(vlm_checkpoint,
                                                                                                family: str) -> None:
    """Text, an image of a 3 x 2 merged grid (not square: rows and columns cannot be swapped unseen), text: the logits
    of every position equal transformers' one forward (its get_rope_index; Qwen3-VL's deepstack at the image's
    positions) when the runner's three calls feed it, when one call does, when the image is cut between two calls; then
    a decoded token by id; and text alone."""
    ckpt = vlm_checkpoint(family)
    ref = transformers_model(ckpt)
    ours = build_model(open_checkpoint(ckpt), 32).eval()
    config = ref.config
    vc = config.vision_config
    rows, cols = 3, 2  # merged positions; the patch grid is twice each
    n = rows * cols
    row = 3 * vc.temporal_patch_size * vc.patch_size**2  # one patch's two frames, as the processor writes them
    pixels = torch.randn(4 * n, row, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 2 * rows, 2 * cols]])
    ids = torch.tensor([[*TEXT_BEFORE, config.vision_start_token_id, *[config.image_token_id] * n,
                         config.vision_end_token_id, *TEXT_AFTER]])
    with torch.no_grad():
        expected = ref(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=(ids == config.image_token_id).int()).logits[0]
        features = ref.model.get_image_features(pixels, grid)
        deep = [f[0] if isinstance(f, (list, tuple)) else f
                for f in getattr(features, "deepstack_features", None) or []]
        place = torch.arange(1, n + 1, dtype=torch.float32)
        channels = torch.stack([place, torch.full_like(place, rows), torch.full_like(place, cols)], dim=-1)
        image = torch.cat([features.pooler_output[0], *deep, channels], dim=-1)[None]
        assert image.shape[-1] == ours.args.embedding_width
        with ours.returns_token_embeddings():
            before, after = ours(ids[:, :3]), ours(ids[:, 3 + n:])
        splits = {"the runner's three calls": [before, image, after],
                  "one call": [torch.cat([before, image, after], 1)],
                  "an image over two calls": [torch.cat([before, image[:, :2]], 1),
                                              torch.cat([image[:, 2:], after], 1)]}
        assert_every_split_matches(ours, splits, expected)
        token = int(expected[-1].argmax())
        longer = torch.cat([ids, torch.tensor([[token]])], 1)
        after_one = ref(input_ids=longer, pixel_values=pixels, image_grid_thw=grid,
                        mm_token_type_ids=(longer == config.image_token_id).int()).logits[0, -1]
        torch.testing.assert_close(ours(torch.tensor([[token]]), torch.tensor([ids.shape[1]]))[0], after_one,
                                   atol=1e-5, rtol=0)
        if not ours.args.hybrid:  # a rewind: the text after the image again at the same slots (a regenerated turn);
            # a hybrid's recurrent state cannot go back, with images or without (docs/hybrid.md)
            ours(after, torch.tensor([3 + n]), True)
            torch.testing.assert_close(ours(after, torch.tensor([3 + n]), True)[0], expected[3 + n:], atol=1e-5,
                                       rtol=0)
        text = torch.tensor([[5, 6, 7, 8, 9]])
        ours.reset_cache()
        torch.testing.assert_close(ours(text, torch.tensor([0]), True), ref(input_ids=text).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_images_of_other_shapes_in_one_call_get_transformers_positions(vlm_checkpoint, family: str) -> None:
    """Text, a 3 x 2 image, text, a 2 x 3 image, text in one call, then in two calls cut inside the second image: each
    image's offset adds up as transformers' get_rope_index places the second after the first."""
    ckpt = vlm_checkpoint(family)
    ref = transformers_model(ckpt)
    ours = build_model(open_checkpoint(ckpt), 48).eval()
    config, vc = ref.config, ref.config.vision_config
    row = 3 * vc.temporal_patch_size * vc.patch_size**2
    grids = [(3, 2), (2, 3)]
    pixels = torch.randn(sum(4 * r * c for r, c in grids), row, generator=torch.Generator().manual_seed(1))
    image_ids = [[config.vision_start_token_id, *[config.image_token_id] * (r * c), config.vision_end_token_id]
                 for r, c in grids]
    ids = torch.tensor([[10, 11, *image_ids[0], 12, *image_ids[1], 13, 14]])
    thw = torch.tensor([[1, 2 * r, 2 * c] for r, c in grids])
    with torch.no_grad():
        expected = ref(input_ids=ids, pixel_values=pixels, image_grid_thw=thw,
                       mm_token_type_ids=(ids == config.image_token_id).int()).logits[0]
        features = ref.model.get_image_features(pixels, thw)
        merged = list(features.pooler_output)
        deep = [list(f) for f in getattr(features, "deepstack_features", None) or []]
        rows = []
        with ours.returns_token_embeddings():
            text = ours(ids)[0]  # every token's own embedding; image positions replaced below
        k = 0
        for t, token in enumerate(ids[0].tolist()):
            if token != config.image_token_id:
                rows.append(text[t])
                continue
            image = 0 if k < grids[0][0] * grids[0][1] else 1
            place = k - (0 if image == 0 else grids[0][0] * grids[0][1])
            r, c = grids[image]
            channels = torch.tensor([place + 1.0, float(r), float(c)])
            rows.append(torch.cat([merged[image][place], *(d[image][place] for d in deep), channels]))
            k += 1
        wide = torch.stack(rows)[None]
        ours.reset_cache()
        torch.testing.assert_close(ours(wide, torch.tensor([0]), True)[0], expected, atol=1e-5, rtol=0)
        cut = 2 + 1 + 6 + 1 + 1 + 1 + 3  # inside the second image
        ours.reset_cache()
        first = ours(wide[:, :cut], torch.tensor([0]), True)[0]
        second = ours(wide[:, cut:], torch.tensor([cut]), True)[0]
        torch.testing.assert_close(torch.cat([first, second]), expected, atol=1e-5, rtol=0)


def test_qwen_vl_rows_fold_back_into_the_pixels_they_were_cut_from(vlm_checkpoint) -> None:
    """The processor's patch rows of one S x S image become the [1, 3, S, S] vision_encoder takes, exactly; rows of
    another grid are refused by name."""
    from models.vision import load_processor

    processor = load_processor(vlm_checkpoint("qwen3_vl")).image_processor
    pixels = torch.rand(1, 3, 64, 64)
    rows, grid_h, grid_w = processor.patchify(pixels[0].numpy(), 16, 2, 2)
    made = {"pixel_values": torch.from_numpy(rows.copy()), "image_grid_thw": torch.tensor([[1, grid_h, grid_w]])}
    assert torch.equal(program_pixels(made, 64), pixels)
    made["image_grid_thw"] = torch.tensor([[1, 2, 8]])
    with pytest.raises(UserError, match="made a 32x128 image and the program's vision_encoder takes 64x64"):
        program_pixels(made, 64)


def test_a_processor_taking_a_range_of_sizes_exports_text_alone_and_says_how_to_get_images(vlm_checkpoint,
                                                                                          tmp_path: Path) -> None:
    """The hub's Qwen-VL (and every Qwen3.5) processors take any size between min and max pixels; a program takes one
    square. Without model.image_size the text decoder is planned alone (a hub Qwen3.5's text export works as before)
    and the console's line says which setting exports the image path."""
    from exporters.components.resolve import plan_export
    from models.vision import text_only

    ckpt = shutil.copytree(vlm_checkpoint("qwen2_5_vl"), tmp_path / "ckpt")
    saved = json.loads((ckpt / "processor_config.json").read_text())
    del saved["image_processor"]["size"]
    saved["image_processor"].update(min_pixels=3136, max_pixels=12845056)  # the hub's older form
    (ckpt / "processor_config.json").write_text(json.dumps(saved))
    plan = plan_export(compose_config("model=hf", f"model.checkpoint={ckpt}", "export.max_seq_len=32"))
    assert [c.name for c in plan.components] == ["decoder"]
    said = text_only(open_checkpoint(ckpt).hf_config, ckpt)
    assert said is not None and "model.image_size=S exports the image path (S a multiple of 28, e.g. 448" in said


def test_m_rope_refuses_ring_caches() -> None:
    """Positions are kept per cache slot: a ring (attention sink, sliding window) would reuse slots."""
    table = RopeTable((1.0, 0.5))
    shape = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4, rope=(("default", table),), mrope_axes=(0, 1),
                 max_context_len=32, call_tokens=8)
    DecoderArgs(**shape)
    with pytest.raises(ValueError, match="ring cache"):
        DecoderArgs(**shape, attention_sink=4)
    with pytest.raises(ValueError, match="ring cache"):
        DecoderArgs(**shape, layer_window=(4, None))
    with pytest.raises(ValueError, match="one stream"):
        DecoderArgs(**{**shape, "mrope_axes": (0, 1, 2)})


def test_model_image_size_chooses_the_square_and_sizes_the_run_s_processor(vlm_checkpoint, tmp_path: Path) -> None:
    """model.image_size sets S for a Qwen-VL checkpoint (the hub's processors take a range): the plan's geometry, the
    processor files the run keeps (least = most pixels = S * S), from which the processor makes that grid. A side
    that is no multiple of patch x merge, a size for a family whose processor fixes it, or one for a text checkpoint
    is refused before any weight is read."""
    from models.vision import load_processor

    ckpt = shutil.copytree(vlm_checkpoint("qwen3_vl"), tmp_path / "ckpt")
    saved = json.loads((ckpt / "processor_config.json").read_text())
    saved["image_processor"]["size"] = {"shortest_edge": 3136, "longest_edge": 12845056}  # the hub's range
    (ckpt / "processor_config.json").write_text(json.dumps(saved))
    run = tmp_path / "run"
    geometry = sized_run(ckpt, run, "model.image_size=96", "export.max_seq_len=32")
    assert (geometry.image_size, geometry.tokens) == (96, 9)
    sized = json.loads((run / "processor_config.json").read_text())["image_processor"]["size"]
    assert sized == {"shortest_edge": 96 * 96, "longest_edge": 96 * 96}
    from PIL import Image

    made = load_processor(run)(images=Image.new("RGB", (50, 40)), text="<|image_pad|>", return_tensors="pt")
    assert made["image_grid_thw"].tolist() == [[1, 6, 6]] and tuple(program_pixels(made, 96).shape) == (1, 3, 96, 96)
    for overrides, says in ((["model.image_size=100"], "multiple of 32"),
                            ([f"model.checkpoint={vlm_checkpoint('llava')}", "model.image_size=64"],
                             "LlavaForConditionalGeneration's images are 28 x 28")):
        with pytest.raises(ModelError, match=says):
            checked_config(compose_config("model=hf", f"model.checkpoint={ckpt}", *overrides, "export.max_seq_len=32"))
    with pytest.raises(UserError, match="model.checkpoint is a text model"):
        checked_config(compose_config("model.image_size=64"))
    # bf16 holds whole numbers to 256: an image's places (1 + index) must stay exact in the decoder's input.
    with pytest.raises(UserError, match="quant.dtype=bf16 holds whole numbers exactly only up to 256"):
        checked_config(compose_config("model=hf", f"model.checkpoint={ckpt}", "model.image_size=544", "quant=bf16",
                                      "export.max_seq_len=320"))


def test_qwen2_5_vl_windows_of_several_positions_and_padded_ones_are_transformers(vlm_checkpoint) -> None:
    """The tiny checkpoint's windows hold one merged position each; here 56 px windows on an 84 px image (3 x 3
    positions: windows of 2 x 2, 2 x 1, 1 x 2 and 1 x 1, three of them padded in transformers' window order) give the
    tower's output transformers gives."""
    from models.qwen_vl_images import QwenVlSquareImages
    from models.vision_encoder import load_vision_encoder

    ckpt = vlm_checkpoint("qwen2_5_vl")
    config = open_checkpoint(ckpt).hf_config
    config.vision_config.window_size = 56
    encoder = load_vision_encoder(str(ckpt), config, geometry=(84, 9))
    ref = transformers_model(ckpt)
    ref.model.visual.window_size = ref.config.vision_config.window_size = 56
    pixels = torch.rand(1, 3, 84, 84, generator=torch.Generator().manual_seed(2)) * 2 - 1
    rows, grid_h, grid_w = QwenVlSquareImages().patchify(pixels[0].numpy(), 14, 2, 2)
    with torch.no_grad():
        expected = ref.model.get_image_features(torch.from_numpy(rows.copy()),
                                                torch.tensor([[1, grid_h, grid_w]])).pooler_output[0]
        ours = encoder(pixels)[0, :, :expected.shape[-1]]
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    assert (encoder.window_mask == 0).sum() < encoder.window_mask.numel()  # the windows mask something
