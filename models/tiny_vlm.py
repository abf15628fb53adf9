"""Tiny vision-language checkpoints, built offline by transformers' own classes: the fixtures of issue 42's tests.

No vision-language weights ship in a pip package, so each family (``models.vision.VISION_LANGUAGE``) is built
here from a small config, with the tiny text tokenizer plus the family's image tokens and a processor saved beside
it, as the hub's checkpoints are. The text side is fitted to the corpus for a few seconds (peaked logits, as for
the text fixtures); the vision side keeps its seeded random weights. Every family makes 4 embedding positions per
image. Built once per recipe and cached (``models.tiny.built_once``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from models.tiny import BOS_ID, CORPUS, EOS_ID, built_once, fit_to_corpus, recipe_key, train_tokenizer

TEXT_VOCAB = 384
TEXT_ARCH: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2}
VISION_ARCH: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 2}
IMAGE_TOKENS = 4  # embedding positions per image, every family below


def tiny_tokenizer(special: dict[str, str]) -> Any:
    """The tiny text tokenizer with a family's special tokens (here and in ``models.tiny_alm``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(TEXT_VOCAB), bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<unk>", extra_special_tokens=special)


def _llava() -> tuple[Any, Any]:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor

    tok = tiny_tokenizer({"image_token": "<image>"})
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION_ARCH, image_size=28, patch_size=14, projection_dim=32),
        text_config=LlamaConfig(**TEXT_ARCH, vocab_size=len(tok), bos_token_id=BOS_ID, eos_token_id=EOS_ID),
        image_token_index=tok.image_token_id, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_seq_length=IMAGE_TOKENS, architectures=["LlavaForConditionalGeneration"])
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                                   crop_size={"height": 28, "width": 28}),
                               tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)
    return config, processor


def _gemma3() -> tuple[Any, Any]:
    from transformers import (Gemma3Config, Gemma3ImageProcessor, Gemma3Processor, Gemma3TextConfig,
                              SiglipVisionConfig)

    tok = tiny_tokenizer({"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                      "eoi_token": "<end_of_image>"})
    config = Gemma3Config(
        vision_config=SiglipVisionConfig(**VISION_ARCH, image_size=56, patch_size=14, vision_use_head=False),
        text_config=Gemma3TextConfig(**TEXT_ARCH, head_dim=16, vocab_size=len(tok), sliding_window=16,
                                     bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0),
        mm_tokens_per_image=IMAGE_TOKENS, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id, architectures=["Gemma3ForConditionalGeneration"])
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 56, "width": 56}),
                                tokenizer=tok, image_seq_length=IMAGE_TOKENS)
    return config, processor


def _idefics3() -> tuple[Any, Any]:
    from transformers import (Idefics3Config, Idefics3ImageProcessor, Idefics3Processor, Idefics3VisionConfig,
                              LlamaConfig)

    tok = tiny_tokenizer({"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                      "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(**VISION_ARCH, image_size=32, patch_size=8),
        text_config=LlamaConfig(**TEXT_ARCH, vocab_size=len(tok), bos_token_id=BOS_ID, eos_token_id=EOS_ID),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
        architectures=["Idefics3ForConditionalGeneration"])
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": 32},
                                               max_image_size={"longest_edge": 32}),
        tokenizer=tok, image_seq_len=IMAGE_TOKENS)
    return config, processor


def _lfm2_vl() -> tuple[Any, Any]:
    """A conv layer and an attention layer (the hybrid decoder); SigLIP2's 2 x 2 position grid resized to the 4 x 4
    patches of a 32 px image (as the hub's 16 x 16 grid to 32 x 32 at 512 px), pixel-unshuffled to 4 positions."""
    from transformers import Lfm2Config, Lfm2VlConfig, Lfm2VlProcessor, Siglip2VisionConfig

    from models.lfm2_vl_images import Lfm2VlSquareImages

    tok = tiny_tokenizer({"image_token": "<image>", "image_start_token": "<|image_start|>",
                      "image_end_token": "<|image_end|>", "image_thumbnail_token": "<|img_thumbnail|>"})
    config = Lfm2VlConfig(
        vision_config=Siglip2VisionConfig(**VISION_ARCH, patch_size=8, num_patches=4, vision_use_head=False),
        text_config=Lfm2Config(**TEXT_ARCH, layer_types=["conv", "full_attention"], vocab_size=len(tok),
                               bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0),
        downsample_factor=2, projector_hidden_size=32, image_token_id=tok.image_token_id,
        architectures=["Lfm2VlForConditionalGeneration"])
    images = Lfm2VlSquareImages(encoder_patch_size=8, downsample_factor=2, do_image_splitting=False,
                                min_image_tokens=IMAGE_TOKENS, max_image_tokens=IMAGE_TOKENS, tile_size=32,
                                use_thumbnail=False)
    return config, Lfm2VlProcessor(images, tok)


QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
               "vision_end_token": "<|vision_end|>"}


def _qwen_processor(base: str, tok: Any, side: int, patch: int) -> Any:
    import transformers

    from models.qwen_vl_images import QwenVlSquareImages, images_only

    images = QwenVlSquareImages(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                size={"shortest_edge": side * side, "longest_edge": side * side})
    return images_only(getattr(transformers, base))(images, tok)


def _qwen_ids(tok: Any) -> dict[str, int]:
    return {"image_token_id": tok.image_token_id, "video_token_id": tok.video_token_id,
            "vision_start_token_id": tok.vision_start_token_id, "vision_end_token_id": tok.vision_end_token_id}


def _qwen2_5_vl() -> tuple[Any, Any]:
    """Windows of one merged position (28 px), so the windowed blocks mask something; the second block attends over
    the whole image; contiguous M-RoPE sections."""
    from transformers import Qwen2_5_VLConfig

    tok = tiny_tokenizer(QWEN_TOKENS)
    config = Qwen2_5_VLConfig(
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "window_size": 28, "fullatt_block_indexes": [1]},
        text_config={**TEXT_ARCH, "vocab_size": len(tok), "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        **_qwen_ids(tok), architectures=["Qwen2_5_VLForConditionalGeneration"])
    return config, _qwen_processor("Qwen2_5_VLProcessor", tok, 56, 14)


def _qwen3_vl() -> tuple[Any, Any]:
    """A 3 x 3 position table resampled to the 4 x 4 patches; deepstack from the first block into the first decoder
    layer; interleaved M-RoPE sections."""
    from transformers import Qwen3VLConfig

    tok = tiny_tokenizer(QWEN_TOKENS)
    config = Qwen3VLConfig(
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                       "patch_size": 16, "spatial_merge_size": 2, "num_position_embeddings": 9,
                       "deepstack_visual_indexes": [0]},
        text_config={**TEXT_ARCH, "head_dim": 16, "vocab_size": len(tok), "bos_token_id": BOS_ID,
                     "eos_token_id": EOS_ID,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                         "mrope_interleaved": True}},
        **_qwen_ids(tok), architectures=["Qwen3VLForConditionalGeneration"])
    return config, _qwen_processor("Qwen3VLProcessor", tok, 64, 16)


def _qwen3_5() -> tuple[Any, Any]:
    """Qwen3-VL's tower without deepstack beside a hybrid decoder: a Gated DeltaNet layer then a gated attention
    layer with partial, interleaved M-RoPE."""
    from transformers import Qwen3_5Config

    tok = tiny_tokenizer(QWEN_TOKENS)
    config = Qwen3_5Config(
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                       "patch_size": 16, "spatial_merge_size": 2, "num_position_embeddings": 9},
        text_config={**TEXT_ARCH, "head_dim": 16, "vocab_size": len(tok), "bos_token_id": BOS_ID,
                     "eos_token_id": EOS_ID, "layer_types": ["linear_attention", "full_attention"],
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        **_qwen_ids(tok), architectures=["Qwen3_5ForConditionalGeneration"])
    return config, _qwen_processor("Qwen3VLProcessor", tok, 64, 16)


GEMMA4_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}


def _gemma4() -> tuple[Any, Any]:
    """Four layers, the last two reading the first two's caches (KV sharing), per-layer embeddings, soft-capped
    logits; a tower of 2 layers (one kv head for two query heads, clipped linears, standardized output) on 6 x 6
    patches of 8 px pooled 3 x 3 into 4 positions. The processor is built first: it adds ``<|video|>`` to the
    tokenizer (transformers' Gemma4Processor does), and every id the config names must be in the vocabulary."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    from models.gemma4_images import Gemma4SquareImages, images_only

    tok = tiny_tokenizer(GEMMA4_TOKENS)
    images = Gemma4SquareImages(patch_size=8, pooling_kernel_size=3, max_soft_tokens=70,
                                size={"height": 48, "width": 48})
    processor = images_only()(images, tok)
    text = Gemma4TextConfig(
        **{**TEXT_ARCH, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32, vocab_size=len(tok),
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=len(tok), sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        final_logit_softcapping=10.0, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=tok.pad_token_id)
    vision = Gemma4VisionConfig(**{**VISION_ARCH, "num_key_value_heads": 1}, head_dim=16, patch_size=8,
                                pooling_kernel_size=3, position_embedding_size=16, standardize=True,
                                use_clipped_linears=True)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          image_token_id=tok.image_token_id, boi_token_id=tok.convert_tokens_to_ids(tok.boi_token),
                          eoi_token_id=tok.convert_tokens_to_ids(tok.eoi_token),
                          audio_token_id=tok.audio_token_id, video_token_id=processor.video_token_id,
                          architectures=["Gemma4ForConditionalGeneration"])
    return config, processor


def finite_clamps(tower: nn.Module, bound: float) -> None:
    """Every ``Gemma4ClippableLinear`` of a Gemma 4 tower clamping its input and output to ``[-bound, bound]``
    (transformers initializes the bounds to infinity, which clamps nothing a test could see read wrong)."""
    for name, buffer in tower.named_buffers():
        if name.endswith(("input_min", "output_min")):
            buffer.fill_(-bound)
        elif name.endswith(("input_max", "output_max")):
            buffer.fill_(bound)


def _gemma4_untrained(model: Any) -> None:
    """What transformers initializes to a constant, and what the text fitting never touches, drawn at random: else a
    parity test could not tell a position, a standardization, a layer scalar, a clamp or the pad token's per-layer
    row (what an image's tokens look up) read wrong from one left out."""
    with torch.no_grad():
        tower = model.model.vision_tower
        tower.patch_embedder.position_embedding_table.normal_(0.0, 0.5)
        tower.std_bias.normal_(0.0, 0.5)
        tower.std_scale.uniform_(0.5, 2.0)
        finite_clamps(tower, 3.0)
        for layer in model.model.language_model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
        table = model.model.language_model.embed_tokens_per_layer.weight
        table[model.config.text_config.pad_token_id].normal_(0.0, 0.5)


#: family -> what its tiny checkpoint draws at random after the text is fitted (see _gemma4_untrained).
UNTRAINED: dict[str, Callable[[Any], None]] = {"gemma4": _gemma4_untrained}

#: family (``models.vision.VisionLanguage.name``) -> its tiny config and processor.
TINY_VLM: dict[str, Callable[[], tuple[Any, Any]]] = {"llava": _llava, "gemma3": _gemma3, "idefics3": _idefics3,
                                                      "lfm2_vl": _lfm2_vl, "qwen2_5_vl": _qwen2_5_vl,
                                                      "qwen3_vl": _qwen3_vl, "qwen3_5": _qwen3_5,
                                                      "gemma4": _gemma4}


def write_tiny_vlm_checkpoint(out_dir: str | Path, family: str, seed: int = 0, train_steps: int = 100) -> Path:
    """A seeded tiny vision-language checkpoint of ``family`` in ``out_dir``: ``config.json``, ``model.safetensors``,
    the tokenizer with the image tokens, the processor's files, ``generation_config.json``."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = recipe_key(vlm=family, seed=seed, train_steps=train_steps, code=code)
    return built_once(key, lambda out: _build(out, family, seed, train_steps), Path(out_dir))


def _build(out: Path, family: str, seed: int, train_steps: int) -> Path:
    config, processor = TINY_VLM[family]()
    return save_multimodal(out, config, processor.tokenizer, [processor], seed, train_steps, UNTRAINED.get(family))


def save_multimodal(out: Path, config: Any, tokenizer: Any, beside: list[Any], seed: int, train_steps: int,
                    untrained: Callable[[Any], None] | None = None) -> Path:
    """transformers' model of ``config`` with seeded random weights, its text side fitted to the corpus (then
    ``untrained`` applied to it), saved in ``out`` with ``beside`` (a processor, a tokenizer, a feature extractor) and
    ``generation_config.json``: every tiny multimodal checkpoint (here and in ``models.tiny_alm``)."""
    import transformers
    from transformers import GenerationConfig

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():  # Gemma 3's projector starts at zero, which would make every image invisible
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name and not p.any():
                p.normal_(0.0, 0.05)
    if train_steps:
        fit_to_corpus(model, tokenizer(CORPUS)["input_ids"], train_steps, seed)
    if untrained is not None:
        untrained(model)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    for files in beside:
        files.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(out)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny vision-language checkpoint (random vision tower, text "
                                                 "fitted to a short corpus) with its processor.")
    parser.add_argument("family", choices=sorted(TINY_VLM))
    parser.add_argument("out", help="the checkpoint folder to write")
    args = parser.parse_args()
    print(write_tiny_vlm_checkpoint(args.out, args.family))


if __name__ == "__main__":
    main()
