"""Vision-language checkpoints (LLaVA, Gemma 3, Idefics3 / SmolVLM, LFM2-VL, Qwen-VL, Gemma 4): tiny ones built by transformers' own
classes.

Fast: each family's text decoder and vision encoder against transformers eagerly; every refusal at the config
check. Slow: one program per family, with vision_encoder, token_embedding and text_decoder beside decode_one_token, run by
ExecuTorch's stock MultimodalRunner on the processor's output: transformers' greedy tokens, token for token.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from exporters.errors import UserError
from exporters.export import checked_config
from exporters.program.audio import AUDIO_METHOD
from exporters.program.vision import IMAGE_SIZE, IMAGE_TOKEN_ID, IMAGE_TOKENS, VISION_METHOD, program_pixels
from exporters.release.bundle import make_bundle
from exporters.runtime.generator import Generator, SamplingConfig
from models.checkpoint import build_model, open_checkpoint
from models.decoder import id_digits
from models.tiny_vlm import IMAGE_TOKENS as TINY_IMAGE_TOKENS
from models.tiny_vlm import TINY_VLM
from models.vision_encoder import load_vision_encoder
from tests.helpers import VLM_PROGRAM as PROGRAM
from tests.helpers import compose_config, transformers_model, vlm_program_overrides

FAMILIES = list(TINY_VLM)
NEW_TOKENS = 8
# Where the prompt's image goes: the processor expands this into the image's tokens (Gemma 3's begin-of-image token).
IMAGE_MARK = {"llava": "<image>", "gemma3": "<start_of_image>", "idefics3": "<image>", "lfm2_vl": "<image>",
              "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>", "gemma4": "<|image|>"}
# Families whose program takes one square: a picture of another shape is stretched to it (docs/vision.md).
STRETCHED = ("lfm2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4")
QWEN_VL = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")


def picture():  # type: ignore[no-untyped-def]
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(40, 50, 3) * 255).astype("uint8"))


def prompt_of(family: str) -> str:
    return f"Once upon a {IMAGE_MARK[family]} time there"


def processed(ckpt: Path, family: str):  # type: ignore[no-untyped-def]
    """A 50x40 picture and a prompt around it, as the checkpoint's own processor makes them (LFM2-VL's: ours, on
    transformers' SigLIP2 one, as transformers' needs torchvision)."""
    from models.vision import load_processor

    return load_processor(ckpt)(images=picture(), text=prompt_of(family),
                                return_tensors="pt")  # a BatchFeature, as generate_hf takes


def transformers_features(ref, family: str, pixels: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' image features of one ``[1, 3, S, S]`` image, given as each family's processor writes it."""
    if family in QWEN_VL:  # the processor's rows; Qwen3-VL's deepstack features beside the merged ones
        from models.qwen_vl_images import QwenVlSquareImages

        vc = ref.config.vision_config
        rows, grid_h, grid_w = QwenVlSquareImages().patchify(pixels[0].numpy(), vc.patch_size, vc.spatial_merge_size,
                                                             vc.temporal_patch_size)
        out = ref.model.get_image_features(torch.from_numpy(rows.copy()), torch.tensor([[1, grid_h, grid_w]]))
        return torch.cat([out.pooler_output[0], *(f[0] if isinstance(f, (list, tuple)) else f
                                                  for f in getattr(out, "deepstack_features", None) or [])], dim=-1)
    if family == "gemma4":  # patch rows (channel fastest) and each row's (x, y)
        patch = ref.config.vision_config.patch_size
        grid = pixels.shape[-1] // patch
        rows = pixels.reshape(1, 3, grid, patch, grid, patch).permute(0, 2, 4, 3, 5, 1).reshape(1, grid**2, -1)
        xs, ys = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy")
        features = ref.model.get_image_features(rows, torch.stack([xs, ys], -1).reshape(1, -1, 2)).pooler_output
        return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    if family == "lfm2_vl":  # SigLIP2 NaFlex: patch rows (channel fastest), the grid, a mask of real patches
        patch = ref.config.vision_config.patch_size
        grid = pixels.shape[-1] // patch
        rows = pixels.reshape(1, 3, grid, patch, grid, patch).permute(0, 2, 4, 3, 5, 1).reshape(1, grid**2, -1)
        args = (rows, torch.tensor([[grid, grid]]), torch.ones(1, grid**2, dtype=torch.int32))
        features = ref.model.get_image_features(*args).pooler_output
    else:
        features = ref.model.get_image_features(pixels.unsqueeze(1) if family == "idefics3" else pixels,
                                                **({"vision_feature_layer": ref.config.vision_feature_layer,
                                                    "vision_feature_select_strategy": "default"}
                                                   if family == "llava" else {})).pooler_output
    return features[0] if isinstance(features, (list, tuple)) else features


@pytest.mark.parametrize("family", FAMILIES)
def test_the_text_decoder_of_a_vision_language_checkpoint_matches_transformers(vlm_checkpoint, family: str) -> None:
    ckpt = vlm_checkpoint(family)
    ours = build_model(open_checkpoint(ckpt), 32)
    ref = transformers_model(ckpt)
    tokens = torch.randint(3, 380, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens, torch.tensor([0]), full_logits=True), expected, atol=1e-4, rtol=0)
        # The embeddings path (what text_decoder takes) computes the same.
        ours.reset_cache()
        torch.testing.assert_close(ours(ours.text_embeddings(tokens), torch.tensor([0])), expected[:, -1],
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vision_encoder_computes_transformers_image_features(vlm_checkpoint, family: str) -> None:
    ckpt = vlm_checkpoint(family)
    encoder = load_vision_encoder(str(ckpt), open_checkpoint(ckpt).hf_config)
    ref = transformers_model(ckpt)
    pixels = torch.rand(1, 3, encoder.image_size, encoder.image_size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ours = encoder(pixels)
        features = transformers_features(ref, family, pixels)
    width = build_model(open_checkpoint(ckpt), 32).args.embedding_width  # Qwen-VL's: wide (models.decoder)
    assert ours.shape == (1, TINY_IMAGE_TOKENS, width)
    features = features.reshape(1, TINY_IMAGE_TOKENS, -1)
    torch.testing.assert_close(ours[..., :features.shape[-1]], features, atol=1e-5, rtol=0)
    if family == "gemma4":  # the image token's id, which the decoder's per-layer embeddings look up (as pad)
        digits = ours[0, :, -3:]
        assert torch.equal(digits, id_digits(torch.full((TINY_IMAGE_TOKENS,), ref.config.image_token_id),
                                             torch.float32))
    if family in QWEN_VL:  # the image channels the decoder places M-RoPE positions by: place, rows, columns
        side = int(TINY_IMAGE_TOKENS**0.5)
        place = torch.arange(1, TINY_IMAGE_TOKENS + 1, dtype=torch.float32)
        assert torch.equal(ours[0, :, -3:], torch.stack([place, torch.full_like(place, side),
                                                         torch.full_like(place, side)], dim=-1))


@pytest.mark.parametrize("family,layout", [("gemma3", "vision_tower.vision_model."),  # google/gemma-3-*
                                           ("llava", "model.vision_tower."),  # transformers 5 in memory
                                           ("lfm2_vl", "model.vision_tower.vision_model.")])  # transformers 4.5x
def test_the_vision_tower_is_read_alone_from_each_layout_checkpoints_have(vlm_checkpoint, tmp_path: Path, family: str,
                                                                          layout: str) -> None:
    """load_vision_encoder reads only the tower's and the projector's tensors (a 4B checkpoint's text decoder is not
    loaded for them), under each key layout transformers reads; a missing one is named."""
    import shutil

    from safetensors.torch import load_file, save_file

    from models.errors import ModelError

    ckpt = vlm_checkpoint(family)
    moved = shutil.copytree(ckpt, tmp_path / "moved")
    tensors = load_file(ckpt / "model.safetensors")
    tower = next(p for p in ("model.vision_tower.", "vision_tower.") if any(k.startswith(p) for k in tensors))
    renamed = {(layout + k[len(tower):].removeprefix("vision_model.") if k.startswith(tower) else k): v
               for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, moved / "model.safetensors", metadata={"format": "pt"})
    config = open_checkpoint(ckpt).hf_config
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    reference = load_vision_encoder(str(ckpt), config)
    pixels = pixels[..., :reference.image_size, :reference.image_size]
    with torch.no_grad():
        assert torch.equal(load_vision_encoder(str(moved), config)(pixels), reference(pixels))
    patch = next(k for k in renamed if k.startswith(layout) and "patch_embedding.weight" in k)
    save_file({k: v for k, v in renamed.items() if k != patch}, moved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="missing from the safetensors files: tower.embeddings.patch_embedding.weight"):
        load_vision_encoder(str(moved), config)


# LLaVA's program runs through exporters.generate (two images in one prompt, below) in the full run; through the stock
# MultimodalRunner with -m extended, for the full run's time. Idefics3's too: its SigLIP layers are Gemma 3's (and
# LFM2-VL's SigLIP2), its connector a reshape and a linear, its eager parity a fast test. Qwen2.5-VL's and Qwen3.5's
# programs run the kernels Qwen3-VL's does (the M-RoPE positions through the runner) and LFM2-VL's (a hybrid decoder);
# their towers and positions are fast tests here and in tests/test_qwen_vl.py. Gemma 3's (SigLIP, a pooled projector,
# its decoder) runs kernels LFM2-VL's tower and tests/test_families.py's Gemma 3 programs run: extended since Qwen-VL
# joined the full run (the cut it brought).
RUNNER_EXTENDED = ("llava", "idefics3", "gemma3", "qwen2_5_vl", "qwen3_5")


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.extended) if f in RUNNER_EXTENDED else f
                                    for f in FAMILIES])
def test_multimodal_runner_writes_transformers_greedy_tokens(exported, vlm_checkpoint, alm_checkpoint, gemma4_assistant,
                                                             family: str, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """ExecuTorch's MultimodalRunner (generate_hf: text | image | text, then one token at a time through
    token_embedding and text_decoder) on the program, against transformers' generate on the same processor output.
    Gemma 3 attends bidirectionally within an image in transformers when given token_type_ids; the runner's
    text_decoder cannot know an image call from a text one, so transformers runs causally here (docs/vision.md)."""
    import transformers
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, generate_hf

    from exporters.runtime.programs import register_runtime_kernels

    register_runtime_kernels()  # the programs' llama:: kernels, as an app links them (the export may be another worker's)

    # Gemma 4's images through its program of every modality (the one export tests/helpers.py names for four tests)
    ckpt = alm_checkpoint(family) if family == "gemma4" else vlm_checkpoint(family)
    result = exported(*vlm_program_overrides(family, ckpt, gemma4_assistant))
    m = result.manifest
    assert m.validation.passed and m.validation.text_decoder_kl < 1e-9
    vision = m.components["vision"].vision
    assert vision.check.passed and vision.check.cosine > 0.9999 and vision.check.greedy_tokens == vision.check.eager_choices
    # Nothing quantized: the image path is the unquantized model's (the baseline stage's image prompt, the same tokens).
    quality = vision.check.unquantized
    assert quality.encoder_cosine > 0.9999 and quality.kl_max < 1e-6 and quality.top1 == 1.0
    assert set(m.methods) == {"decode", "token_embedding", "text_decoder", VISION_METHOD, *(
        ["verify", "draft_propose", AUDIO_METHOD] if family == "gemma4" else [])}
    assert m.methods[VISION_METHOD].inputs[0].shape == [1, 3, vision.image_size, vision.image_size]
    assert m.methods["text_decoder"].inputs[0].name == "embeddings"
    # The whole tower is one XNNPACK partition (LayerNorm in ops XNNPACK takes, no-op expands dropped); Gemma 3's
    # projector norm, a mean over the last dim of [1, N, D], ends a second one.
    assert m.methods[VISION_METHOD].delegated_partitions == (2 if family == "gemma3" else 1)
    # Four methods, each weight stored once: the decoder's (decode and text_decoder; the embedding table read by
    # decode and token_embedding) and the vision encoder's (and Gemma 4's assistant's), all fp32 here.
    stored = m.program.storage["named_data_bytes"] + m.program.storage["constant_buffer_bytes"]
    weights = 4 * sum(entry.parameters or 0 for entry in m.components.values())
    assert weights * 0.95 < stored < weights * 1.1, (stored, weights)
    config = transformers.AutoConfig.from_pretrained(ckpt)
    assert m.constant_methods[IMAGE_TOKENS] == TINY_IMAGE_TOKENS and m.constant_methods[IMAGE_SIZE] == vision.image_size
    assert m.constant_methods[IMAGE_TOKEN_ID] == config.image_token_id == vision.image_token_id
    run = result.pte_path.parent
    assert json.loads((run / "processor_config.json").read_text()) == json.loads((ckpt / "processor_config.json").read_text())

    inputs = processed(ckpt, family)
    reference = {k: v for k, v in inputs.items() if k != "token_type_ids"}  # what transformers takes
    # What the runner takes: one image [1, 3, S, S] (Idefics3 adds an images dimension; LFM2-VL writes patch rows).
    inputs = transformers.BatchFeature({k: v for k, v in inputs.items() if k not in ("spatial_shapes",
                                                                                   "pixel_attention_mask")})
    inputs["pixel_values"] = program_pixels(reference, vision.image_size)
    runner = MultimodalRunner(str(result.pte_path), str(run / "tokenizer.json"))
    pieces: list[str] = []
    generate_hf(runner, inputs=inputs, config=GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, echo=False),
                image_token_id=config.image_token_id, token_callback=pieces.append)
    with torch.no_grad():
        generated = transformers_model(ckpt).generate(**reference, max_new_tokens=NEW_TOKENS, do_sample=False)
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(ckpt).decode(generated[0, inputs["input_ids"].shape[1]:])
    assert "".join(pieces) == expected
    # exporters.generate's image= path (the processor saved in the run, our driver) writes the same text.
    picture().save(tmp_path / "picture.png")
    generator = Generator(result.pte_path)
    with caplog.at_level(logging.INFO, logger="exporters"):
        made = generator.with_images(prompt_of(family), [str(tmp_path / "picture.png")])
    assert made.ids == inputs["input_ids"][0].tolist()
    # LFM2-VL's program takes one square: a 50 x 40 picture is stretched to it, and the console says so.
    stretched = f"is 50x40; the program takes {vision.image_size}x{vision.image_size} images: stretched to it"
    assert (stretched in caplog.text) == (family in STRETCHED)
    assert generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), media=made).text == expected
    # A release bundle carries the processor and says how an app feeds an image.
    bundle, _ = make_bundle(run, tmp_path / "release")
    assert (bundle / "processor_config.json").is_file() and "## Images" in (bundle / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.extended  # the full run's time: the fp32 programs above check the report's path (exactly zero cost)
def test_a_quantized_program_reports_what_quantization_cost_the_image_path(exported, vlm_checkpoint) -> None:
    """quant=8da4w on LFM2-VL (a hybrid decoder): quant.vision=auto gives the encoder 8da8w; the program validates
    against its eager counterparts, and the manifest says what quantization cost the image path against the
    unquantized encoder and decoder."""
    ckpt = vlm_checkpoint("lfm2_vl")
    result = exported("model=hf", f"model.checkpoint={ckpt}", *PROGRAM, "quant=8da4w")
    vision = result.manifest.components["vision"].vision
    assert vision.quantization.startswith("8da8w") and vision.check.passed
    quality = vision.check.unquantized
    assert 0.99 < quality.encoder_cosine < 1 and 0 < quality.kl_mean <= quality.kl_max and quality.top1 >= 0.5


@pytest.mark.parametrize("overrides,says", [
    (["backend=coreml", "export.layout=split", "export.methods=[prefill,decode]"], "exports fixed-size calls"),
    (["export.max_seq_len=4"], "Set export.max_seq_len=5 or more"),
    (["quant=pt2e_xnnpack_dynamic"], "quant.pt2e=xnnpack_dynamic"),
    (["export.methods=[forward,token_embedding]"], "token_embedding without text_decoder"),
])
def test_what_a_vision_language_export_cannot_do_is_refused_before_any_work(vlm_checkpoint, overrides: list[str],
                                                                             says: str) -> None:
    with pytest.raises(UserError, match=says.replace(".", r"\.")):
        checked_config(compose_config("model=hf", f"model.checkpoint={vlm_checkpoint('llava')}", *overrides))


def test_a_draft_model_beside_images_is_refused_and_gemma4s_assistant_is_not(vlm_checkpoint, tiny_checkpoint,
                                                                             gemma4_assistant) -> None:
    """A draft model keeps a cache of its own that no image reaches; Gemma 4's assistant reads the decoder's."""
    with pytest.raises(UserError, match="speculative decoding of image prompts with a draft model is not built yet"):
        checked_config(compose_config("model=hf", f"model.checkpoint={vlm_checkpoint('llava')}",
                                      f"draft.checkpoint={tiny_checkpoint}"))
    ckpt = vlm_checkpoint("gemma4")
    checked_config(compose_config("model=hf", f"model.checkpoint={ckpt}", *PROGRAM,
                                  f"draft.checkpoint={gemma4_assistant(ckpt)}"))


@pytest.mark.parametrize("change,says", [
    ({"max_image_tokens": 12}, "max_image_tokens=12 is not a square"),
    ({"encoder_patch_size": 16}, "encoder_patch_size=16 and config.json's 8 disagree"),
])
def test_lfm2_vl_processors_that_make_no_single_square_are_refused_before_any_work(vlm_checkpoint, tmp_path: Path,
                                                                                   change: dict, says: str) -> None:
    """LFM2-VL's program takes one S x S image whose side the processor's token budget fixes: a budget that is no
    square, or processor files of another checkpoint, are refused at the config check."""
    import shutil

    from models.errors import ModelError

    ckpt = shutil.copytree(vlm_checkpoint("lfm2_vl"), tmp_path / "ckpt")
    saved = json.loads((ckpt / "processor_config.json").read_text())
    saved["image_processor"].update(change)
    (ckpt / "processor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ModelError, match=says):
        checked_config(compose_config("model=hf", f"model.checkpoint={ckpt}", "export.max_seq_len=32"))


def test_patch_rows_of_another_grid_are_refused_and_one_square_folds_back_into_pixels() -> None:
    """A NaFlex processor's output (patch rows, the grid, a mask) becomes the [n, 3, S, S] pixels vision_encoder
    takes, exactly; rows of another grid (a processor that kept a picture's aspect ratio) are refused by name."""
    pixels = torch.rand(2, 3, 32, 32)
    rows = pixels.reshape(2, 3, 4, 8, 4, 8).permute(0, 2, 4, 3, 5, 1).reshape(2, 16, 192)
    made = {"pixel_values": rows, "spatial_shapes": torch.tensor([[4, 4], [4, 4]]),
            "pixel_attention_mask": torch.ones(2, 16, dtype=torch.int32)}
    assert torch.equal(program_pixels(made, 32), pixels)
    made["spatial_shapes"] = torch.tensor([[4, 4], [2, 8]])
    with pytest.raises(UserError, match="made a 16x64 image and the program's vision_encoder takes 32x32"):
        program_pixels(made, 32)


@pytest.mark.parametrize("quant,vision,scheme", [("fp32", "auto", "fp32"), ("8da4w", "auto", "8da8w"),
                                                ("8da4w_emb4w", "auto", "8da8w"), ("bf16", "auto", "fp32"),
                                                ("8da4w", "fp32", "fp32"), ("fp32", "8da4w", "8da4w")])
def test_quant_vision_auto_quantizes_the_encoder_beside_a_quantized_decoder(vlm_checkpoint, quant: str, vision: str,
                                                                             scheme: str) -> None:
    from exporters.quant.vision import vision_scheme

    cfg = checked_config(compose_config("model=hf", f"model.checkpoint={vlm_checkpoint('idefics3')}", f"quant={quant}",
                                        f"quant.vision={vision}"))
    assert vision_scheme(cfg.quant) == scheme


def test_equal_image_embeddings_pass_the_image_check_even_when_zero() -> None:
    """A checkpoint whose projector is all zeros (transformers initializes Gemma 3's so) embeds every image to zeros,
    in the program as eagerly: equal, so the check passes them (torch's cosine of two zero vectors is 0)."""
    from exporters.validation.encoder_prompt import least_cosine as _least_cosine

    zeros, ones = torch.zeros(1, 4, 8), torch.ones(1, 4, 8)
    assert _least_cosine(zeros, zeros) == 1.0 and _least_cosine(ones, ones) == pytest.approx(1.0)
    assert _least_cosine(zeros, ones) == 0.0 and _least_cosine(ones, -ones) == pytest.approx(-1.0)


def test_quant_vision_on_a_text_checkpoint_is_refused(tiny_checkpoint) -> None:
    with pytest.raises(UserError, match="quant.vision=8da8w .* is a text model"):
        checked_config(compose_config("model=hf", f"model.checkpoint={tiny_checkpoint}", "quant.vision=8da8w"))


@pytest.mark.slow
def test_bad_image_prompts_are_refused_before_any_method_runs(exported, vlm_checkpoint, tmp_path: Path) -> None:
    # LFM2-VL's program, which the stock runner's test exports too (nothing checked here is a family's own).
    result = exported("model=hf", f"model.checkpoint={vlm_checkpoint('lfm2_vl')}", *PROGRAM)
    generator = Generator(result.pte_path)
    picture().save(tmp_path / "picture.png")
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(UserError, match="cannot be read as an image"):
        generator.with_images(prompt_of("lfm2_vl"), [str(tmp_path / "notes.png")])
    with pytest.raises(UserError, match="marks 0 image.*and 1 image"):
        generator.with_images("Once upon a time", [str(tmp_path / "picture.png")])
    with pytest.raises(UserError, match="marks 1 image.*and 0 image"):
        generator.with_images(prompt_of("lfm2_vl"), [])
    # The command line too: an image mark without image= is refused, nothing generated.
    from exporters.generate import main

    assert main([str(result.pte_path.parent), f"prompt={prompt_of('lfm2_vl')}", "max_new_tokens=2"]) == 2


def test_quant_vision_schemes_keep_the_image_features(vlm_checkpoint) -> None:
    """Each quant.vision scheme on the eager encoder: its linear layers quantized (fp16: cast), the output in the
    decoder's dtype, close to fp32's (the program is validated against this eager encoder at export)."""
    from exporters.quant.vision import VISION_SCHEMES, quantize_vision

    ckpt = vlm_checkpoint("idefics3")
    config = open_checkpoint(ckpt).hf_config
    reference = load_vision_encoder(str(ckpt), config)
    pixels = torch.rand(1, 3, reference.image_size, reference.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(pixels * 2 - 1)
    for scheme in VISION_SCHEMES[1:]:
        encoder = load_vision_encoder(str(ckpt), config)
        assert quantize_vision(encoder, scheme, 32, torch.float32).startswith(scheme)
        with torch.no_grad():
            got = encoder(pixels * 2 - 1)
        assert got.dtype == torch.float32
        cosine = torch.nn.functional.cosine_similarity(got[0], expected[0], dim=-1).min()
        assert 0.98 < cosine < 1, (scheme, float(cosine))


@pytest.mark.slow
def test_several_images_in_one_prompt_give_transformers_greedy_tokens(exported, vlm_checkpoint, tmp_path: Path) -> None:
    """Two pictures in one LLaVA prompt through exporters.generate: each image one vision_encoder call at its place."""
    import transformers
    from PIL import Image

    ckpt = vlm_checkpoint("llava")
    result = exported("model=hf", f"model.checkpoint={ckpt}", *PROGRAM)
    files = []
    for seed in (0, 1):
        path = tmp_path / f"picture{seed}.png"
        Image.fromarray((np.random.RandomState(seed).rand(40, 50, 3) * 255).astype("uint8")).save(path)
        files.append(str(path))
    prompt = "<image> Once upon a <image> time"
    generator = Generator(result.pte_path)
    made = generator.with_images(prompt, files)
    assert sum(part.is_floating_point() for part in made.parts) == 2
    text = generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), media=made).text
    processor = transformers.AutoProcessor.from_pretrained(ckpt)
    inputs = processor(images=[Image.open(f) for f in files], text=prompt, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == made.ids
    with torch.no_grad():
        generated = transformers_model(ckpt).generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert text == processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:])


def test_random_weights_of_a_vision_language_shape_give_the_decoder_what_it_takes(vlm_checkpoint, tmp_path: Path) -> None:
    """model.random_init=true on a vision-language config (how real shapes are measured): the decoder is made in
    bf16 and cast by quant.dtype, and the encoder's output must be in the dtype the decoder then computes in (the
    runner converts nothing between methods)."""
    from exporters.export import run_stages

    eager, _ = run_stages(compose_config("model=hf", f"model.checkpoint={vlm_checkpoint('gemma3')}",
                                         "model.random_init=true", "export.max_seq_len=32", "validate=false"),
                          tmp_path, stop_after="quantize")
    encoder = eager.components["vision"]
    pixels = torch.zeros(1, 3, encoder.image_size, encoder.image_size)
    assert encoder(pixels).dtype == eager.model.activation_dtype() == torch.float32


@pytest.mark.parametrize("shape,family,size,positions,millions", [("smolvlm-256m", "idefics3", 512, 64, 93.51),
                                                                  ("gemma3-4b", "gemma3", 896, 256, 419.82),
                                                                  ("lfm2-vl-450m", "lfm2_vl", 512, 256, 94.23)])
def test_the_published_shapes_plan_the_programs_their_numbers_are_of(tmp_path: Path, shape: str, family: str,
                                                                     size: int, positions: int,
                                                                     millions: float) -> None:
    """benchmarks.vision_shapes: each shape's config.json plans a vision component of its published geometry, and the
    memory estimate counts its encoder's parameters (as load built them: docs/vision.md's numbers)."""
    from benchmarks.vision_shapes import write_shape
    from exporters.components.resolve import plan_export
    from models.vision_encoder import vision_parameters

    folder = write_shape(shape, tmp_path / shape)
    plan = plan_export(compose_config("model=hf", f"model.checkpoint={folder}", "model.random_init=true",
                                      f"export.max_seq_len={positions + 64}"))
    geometry = plan.component("vision").build.geometry
    assert (geometry.family, geometry.image_size, geometry.tokens) == (family, size, positions)
    assert {"token_embedding", "text_decoder", VISION_METHOD} <= set(plan.methods.specs)
    assert round(vision_parameters(open_checkpoint(folder, need_weights=False).hf_config) / 1e6, 2) == millions
