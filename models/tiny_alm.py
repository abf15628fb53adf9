"""Tiny audio-language checkpoints, built offline by transformers' own classes: the fixtures of the audio tests.

No audio-language weights ship in a pip package, so each family (``models.audio_language.AUDIO_LANGUAGE``) is built
here from a small config with the tiny text tokenizer plus the family's audio tokens, and the family's feature
extractor (Whisper's with 128 mel bins; Gemma 4's own; Granite Speech's settings) saved beside it, as the hub's checkpoints are. The audio tower
takes real 30 s windows (3000 frames), Gemma 4's real recordings: its positions are the real ones, its widths tiny. The text side is fitted to the corpus for a few seconds (peaked
logits); the audio side keeps its seeded random weights. Built once per recipe and cached (``models.tiny.built_once``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from models import granite_speech
from models.tiny import BOS_ID, EOS_ID, built_once, recipe_key
from models.tiny_vlm import TEXT_ARCH, TINY_VLM, finite_clamps, save_multimodal, tiny_tokenizer
from models.tiny_vlm import UNTRAINED as VLM_UNTRAINED

MEL_BINS = 128
WINDOW_POSITIONS = 1500  # Whisper's encoder positions of a 30 s window (3000 frames, halved by its second conv)
AUDIO_WIDTH = 32
# Voxtral stacks intermediate_size / hidden_size encoder states into one embedding (4 in Voxtral Mini): 20 here, so a
# window takes 75 positions and fits one call of the tiny decoder's default 128.
VOXTRAL_STACK = 20


def _features() -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=MEL_BINS)


def _voxtral() -> tuple[Any, Any, list[Any]]:
    """Voxtral's prompt tokens as its tekken tokenizer names them; a Llama decoder."""
    from transformers import LlamaConfig, VoxtralConfig, VoxtralEncoderConfig

    tok = tiny_tokenizer({"audio_token": "[AUDIO]", "begin_audio_token": "[BEGIN_AUDIO]", "inst_token": "[INST]",
                      "end_inst_token": "[/INST]"})
    config = VoxtralConfig(
        audio_config=VoxtralEncoderConfig(hidden_size=AUDIO_WIDTH, intermediate_size=AUDIO_WIDTH * VOXTRAL_STACK,
                                          num_hidden_layers=2, num_attention_heads=2, num_mel_bins=MEL_BINS,
                                          max_source_positions=WINDOW_POSITIONS),
        text_config=LlamaConfig(**TEXT_ARCH, head_dim=16, vocab_size=len(tok), bos_token_id=BOS_ID,
                                eos_token_id=EOS_ID),
        audio_token_id=tok.convert_tokens_to_ids("[AUDIO]"), architectures=["VoxtralForConditionalGeneration"])
    return config, tok, [tok, _features()]


def _qwen2_audio() -> tuple[Any, Any, list[Any]]:
    """Qwen2-Audio's own processor (Whisper's features, its audio tokens); a Qwen2 decoder."""
    from transformers import Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioProcessor, Qwen2Config

    tok = tiny_tokenizer({"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>",
                      "audio_eos_token": "<|audio_eos|>"})
    config = Qwen2AudioConfig(
        audio_config=Qwen2AudioEncoderConfig(d_model=AUDIO_WIDTH, encoder_ffn_dim=2 * AUDIO_WIDTH, encoder_layers=2,
                                             encoder_attention_heads=2, num_mel_bins=MEL_BINS,
                                             max_source_positions=WINDOW_POSITIONS),
        text_config=Qwen2Config(**TEXT_ARCH, vocab_size=len(tok), bos_token_id=BOS_ID, eos_token_id=EOS_ID),
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"), architectures=["Qwen2AudioForConditionalGeneration"])
    return config, tok, [Qwen2AudioProcessor(feature_extractor=_features(), tokenizer=tok)]


def _gemma4() -> tuple[Any, Any, list[Any]]:
    """Every modality of Gemma 4: the tiny vision-language Gemma 4 (``models.tiny_vlm``: four decoder layers, KV
    sharing, per-layer embeddings, an image tower, its processor and tokenizer with Gemma 4's image and audio tokens)
    with an audio tower of two conformer layers 32 wide beside it (its subsampling's first channels are the 128 mel
    bins', which the tower's arithmetic fixes) with clipped linears, and transformers' own audio feature extractor."""
    from transformers import Gemma4AudioConfig, Gemma4AudioFeatureExtractor

    config, processor = TINY_VLM["gemma4"]()
    tok = processor.tokenizer
    config.audio_config = Gemma4AudioConfig(hidden_size=AUDIO_WIDTH, num_hidden_layers=2, num_attention_heads=2,
                                            subsampling_conv_channels=[MEL_BINS, 8], output_proj_dims=24,
                                            use_clipped_linears=True)
    config.audio_config._attn_implementation = "eager"
    config.boa_token_id = tok.convert_tokens_to_ids(tok.boa_token)
    config.eoa_token_index = tok.convert_tokens_to_ids(tok.eoa_token)
    processor.chat_template = TINY_GEMMA4_CHAT
    return config, tok, [processor, Gemma4AudioFeatureExtractor()]


class GraniteFeatureFiles:
    """``preprocessor_config.json`` as ``GraniteSpeechFeatureExtractor`` saves it, written without building one: its
    constructor needs torchaudio (models.granite_speech computes its features without it)."""

    def save_pretrained(self, out: Path) -> None:
        g = granite_speech
        values = {"feature_extractor_type": "GraniteSpeechFeatureExtractor", "processor_class": "GraniteSpeechProcessor",
                  "sampling_rate": g.SAMPLE_RATE, "n_fft": g.N_FFT, "win_length": g.WIN_LENGTH,
                  "hop_length": g.HOP_LENGTH, "n_mels": g.MEL_BINS, "projector_window_size": 15,
                  "projector_downsample_rate": 5, "feature_size": g.MEL_BINS, "padding_value": 0.0, "padding_side": "right",
                  "return_attention_mask": True}
        (Path(out) / "preprocessor_config.json").write_text(json.dumps(values, indent=2) + "\n")


def _granite_speech() -> tuple[Any, Any, list[Any]]:
    """Granite Speech: a conformer of two layers 32 wide in blocks of 200 frames (the published context, so a
    recording past 4 s spans a masked block), a one-layer Q-Former, a Granite decoder whose four multipliers are none
    of them 1, and the decoder's LoRA adapter in the folder as the published checkpoints carry it (``has_lora_adapter``:
    transformers applies it to prompts with audio; :func:`_granite_speech_adapter`)."""
    from transformers import (Blip2QFormerConfig, GraniteConfig, GraniteSpeechConfig, GraniteSpeechEncoderConfig)

    tok = tiny_tokenizer({"audio_token": "<|audio|>"})
    config = GraniteSpeechConfig(
        encoder_config=GraniteSpeechEncoderConfig(input_dim=160, num_layers=2, hidden_dim=AUDIO_WIDTH, num_heads=2,
                                                  output_dim=7, context_size=200, max_pos_emb=512,
                                                  conv_kernel_size=15),
        projector_config=Blip2QFormerConfig(hidden_size=AUDIO_WIDTH, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=2 * AUDIO_WIDTH, encoder_hidden_size=AUDIO_WIDTH,
                                            cross_attention_frequency=1),
        text_config=GraniteConfig(**TEXT_ARCH, vocab_size=len(tok), bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                  embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5,
                                  logits_scaling=2.0, tie_word_embeddings=True),
        audio_token_index=tok.convert_tokens_to_ids("<|audio|>"), has_lora_adapter=True,
        architectures=["GraniteSpeechForConditionalGeneration"])
    return config, tok, [tok, GraniteFeatureFiles()]


def _granite_speech_untrained(model: Any) -> None:
    """The conformer's batch norms drawn away from transformers' identity start (a misread running mean or variance
    would otherwise pass unseen)."""
    with torch.no_grad():
        for module in model.model.encoder.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.normal_(0.0, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)


def _granite_speech_adapter(out: Path, seed: int) -> None:
    """The published checkpoints' LoRA adapter (on the decoder's q and v projections) saved by PEFT beside the weights:
    ``adapter_config.json`` and ``adapter_model.safetensors`` in the model's folder, which transformers loads with it.
    Its B matrices random too (PEFT starts them at zero), so that the audio path computes another decoder."""
    from peft import LoraConfig, get_peft_model
    from transformers import GraniteSpeechForConditionalGeneration

    model = GraniteSpeechForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    adapted.save_pretrained(out)


# The tiny tokenizer has none of Gemma 4's turn tokens: a user turn in plain text, each image and recording marked
# where its content part is, as Gemma 4's template marks them (what chat=true and the server's chats go through).
TINY_GEMMA4_CHAT = ("{% for message in messages %}{{ message['role'] }}: {% for part in message['content'] %}"
                    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'audio' %}<|audio|>"
                    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                    "{% if add_generation_prompt %}model:{% endif %}")


def _gemma4_untrained(model: Any) -> None:
    """What the tiny VLM draws at random (``models.tiny_vlm.UNTRAINED``), and in the audio tower what transformers
    initializes to a constant (finite clamps, each head's scale): else a parity test could not tell them read wrong
    from left out."""
    VLM_UNTRAINED["gemma4"](model)
    with torch.no_grad():
        tower = model.model.audio_tower
        finite_clamps(tower, 2.0)
        for layer in tower.layers:
            layer.self_attn.per_dim_scale.normal_(0.0, 0.5)


#: family (``models.audio_language.AudioLanguage.name``) -> its tiny config, tokenizer and the files saved beside it.
TINY_ALM: dict[str, Callable[[], tuple[Any, Any, list[Any]]]] = {"voxtral": _voxtral, "qwen2_audio": _qwen2_audio,
                                                                 "gemma4": _gemma4, "granite_speech": _granite_speech}
#: family -> what its tiny checkpoint draws at random after the text is fitted.
UNTRAINED: dict[str, Callable[[Any], None]] = {"gemma4": _gemma4_untrained,
                                               "granite_speech": _granite_speech_untrained}


def write_tiny_alm_checkpoint(out_dir: str | Path, family: str, seed: int = 0, train_steps: int = 100) -> Path:
    """A seeded tiny audio-language checkpoint of ``family`` in ``out_dir``: ``config.json``, ``model.safetensors``,
    the tokenizer with the audio tokens, the feature extractor's (or processor's) files, ``generation_config.json``."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = recipe_key(alm=family, seed=seed, train_steps=train_steps, code=code)
    return built_once(key, lambda out: _build(out, family, seed, train_steps), Path(out_dir))


#: family -> what is saved beside its checkpoint once it is written (an adapter of its own).
SAVED_AFTER: dict[str, Callable[[Path, int], None]] = {"granite_speech": _granite_speech_adapter}


def _build(out: Path, family: str, seed: int, train_steps: int) -> Path:
    config, tokenizer, beside = TINY_ALM[family]()
    save_multimodal(out, config, tokenizer, beside, seed, train_steps, UNTRAINED.get(family))
    if family in SAVED_AFTER:
        SAVED_AFTER[family](out, seed)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny audio-language checkpoint (random audio tower, text "
                                                 "fitted to a short corpus) with its feature extractor.")
    parser.add_argument("family", choices=sorted(TINY_ALM))
    parser.add_argument("out", help="the checkpoint folder to write")
    args = parser.parse_args()
    print(write_tiny_alm_checkpoint(args.out, args.family))


if __name__ == "__main__":
    main()
