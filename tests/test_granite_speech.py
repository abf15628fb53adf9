"""Granite Speech (models.granite_speech) against transformers on a tiny checkpoint built by its own classes
(models.tiny_alm: a two-layer conformer in the published 200-frame blocks, a one-layer Q-Former, a Granite decoder).

Fast: the log-mel frames against transformers' own numpy ``spectrogram`` (its feature extractor needs torchaudio, which
has no wheel for the torch we pin); the encoder's embeddings against ``get_audio_features`` at frame counts around its
blocks and windows, eagerly and captured once with the frame count dynamic; the decoder with and without the
checkpoint's LoRA adapter for prompts with audio. Full: the program (audio_encoder, token_embedding, text_decoder with
the adapter, decode without it) run by ExecuTorch's stock MultimodalRunner and by ``exporters.generate audio=`` on the
validation recording through its preprocessor.pte, and a text prompt through decode: transformers' greedy tokens (its
adapter enabled with audio, disabled without), token for token.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, GraniteSpeechForConditionalGeneration

from exporters.errors import UserError
from exporters.export import checked_config
from exporters.program.audio import (AUDIO_METHOD, AUDIO_TOKEN_ID, FRAME_RATE, FRAME_WINDOW, FRAMES_AXIS,
                                     FRAMES_PER_TOKEN, TEXT_DECODER_ADAPTER)
from exporters.program.speech import PREPROCESSOR_FILE
from exporters.release.bundle import make_bundle
from exporters.runtime.audio import read_audio
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.validation.speech import VALIDATION_RECORDING
from models.granite_speech import GraniteLogMel, load_granite_speech_audio, reference_features
from tests.helpers import compose_config, stock_runner_text

# Frames around the conformer's 200-frame blocks and the projector's 15-frame windows: one frame, a window less one, a
# window, a block less one, a block, a block and one, and more than two blocks.
FRAMES = (1, 14, 15, 199, 200, 201, 437)
NEW_TOKENS = 8
PROGRAM = ("export.methods=[decode]", "export.layout=split", "export.max_seq_len=96")


@pytest.fixture(scope="module")
def checkpoint(alm_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return alm_checkpoint("granite_speech")


@pytest.fixture(scope="module")
def theirs(checkpoint: Path) -> GraniteSpeechForConditionalGeneration:
    return GraniteSpeechForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> torch.nn.Module:
    return load_granite_speech_audio(str(checkpoint), AutoConfig.from_pretrained(checkpoint))


def transformers_embeddings(theirs: Any, features: torch.Tensor) -> torch.Tensor:
    """transformers' audio embeddings as the decoder takes them: ``GraniteModel`` multiplies the merged embeddings,
    audio rows included, by ``embedding_multiplier``."""
    with torch.no_grad():
        projected = theirs.model.get_audio_features(features).pooler_output
    return projected * theirs.config.text_config.embedding_multiplier


@pytest.mark.parametrize("frames", FRAMES)
def test_granite_speechs_audio_encoder_computes_what_transformers_computes(frames: int, theirs: Any,
                                                                          ours: Any) -> None:
    features = torch.randn(1, frames, 160, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        got = ours(features)
    assert got.shape == (1, 3 * -(-frames // 15), theirs.config.text_config.hidden_size)
    torch.testing.assert_close(got, transformers_embeddings(theirs, features), atol=1e-5, rtol=0)


def test_granite_speechs_audio_encoder_captures_once_for_every_length(theirs: Any, ours: Any) -> None:
    """One capture with the frame count dynamic (a fixed number of blocks, masked past the recording): transformers'
    embeddings at every frame count up to the method's bound, and not one more."""
    from exporters.program.audio import audio_spec

    spec = audio_spec(ours.geometry, 93)
    ours.max_frames = spec.any_frames
    assert spec.any_frames == 465  # 31 windows of 15 frames: 93 positions
    with torch.no_grad():
        program = torch.export.export(ours, spec.inputs_for(0, torch.float32), dynamic_shapes=spec.dynamic_shapes,
                                      strict=False).module()
        for frames in (*FRAMES, 465):
            features = torch.randn(1, frames, 160, generator=torch.Generator().manual_seed(frames))
            torch.testing.assert_close(program(features), transformers_embeddings(theirs, features), atol=1e-5,
                                       rtol=0)
        with pytest.raises(Exception):
            program(torch.randn(1, 466, 160))


def test_granite_speechs_log_mel_frames_are_the_feature_extractors() -> None:
    """Speech and an odd frame count: the frames transformers' numpy spectrogram gives with the extractor's window,
    filters, floor and stacking (float64), within float32 rounding (3e-5 at most, where a power is near the floor)."""
    speech = read_audio(VALIDATION_RECORDING).samples
    for samples in (speech, speech[:16_160 + 37]):
        got = GraniteLogMel()(torch.from_numpy(samples))
        expected = reference_features(samples)
        assert got.shape == expected.shape == (1, (len(samples) // 160 + 1) // 2, 160)
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-4, rtol=0)


def test_the_text_decoder_gives_granites_logits(checkpoint: Path, theirs: Any) -> None:
    """The decoder is Granite's, logits divided by logits_scaling as GraniteForCausalLM divides them; transformers 5's
    GraniteSpeechForConditionalGeneration applies lm_head alone (the same greedy tokens, sharper probabilities). With
    the checkpoint's adapter for prompts with audio read onto it (its keys name transformers' language model), ours
    computes what transformers does with that adapter enabled; without it, what transformers does with it disabled
    (a text prompt)."""
    from models.audio_language import audio_language_of
    from models.checkpoint import build_model, open_checkpoint
    from models.lora import active_adapter, attach_adapters, read_adapter

    decoder = build_model(open_checkpoint(checkpoint), 64)
    family = audio_language_of(theirs.config)
    folder = family.audio_adapter(theirs.config, checkpoint)
    adapter = read_adapter("speech", folder, decoder, family.adapter_prefixes)
    assert adapter.targets == ["q_proj", "v_proj"] and len(adapter.modules) == 2 * theirs.config.text_config.num_hidden_layers
    attach_adapters(decoder, [adapter])
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3]])
    scaling = theirs.config.text_config.logits_scaling
    with torch.no_grad():
        theirs.disable_adapters()
        base, expected_base = decoder(ids, torch.tensor([0]), full_logits=True), theirs(input_ids=ids).logits / scaling
        decoder.reset_cache()
        theirs.enable_adapters()
        with active_adapter(decoder, "speech"):
            heard = decoder(ids, torch.tensor([0]), full_logits=True)
        expected_heard = theirs(input_ids=ids).logits / scaling
    torch.testing.assert_close(base, expected_base, atol=1e-4, rtol=0)
    torch.testing.assert_close(heard, expected_heard, atol=1e-4, rtol=0)
    assert (heard - base).abs().max() > 0.1  # the adapter changes what the decoder computes


def test_the_speech_adapter_with_external_weights_is_refused_before_any_work(checkpoint: Path) -> None:
    """text_decoder's adapter would need a data file of its own beside the base's: not built, refused by name."""
    with pytest.raises(UserError, match="LoRA adapter for prompts with audio .* export.weights=external with that "
                                        "adapter is not built yet"):
        checked_config(compose_config("model=hf", f"model.checkpoint={checkpoint}", "export.weights=external",
                                      *PROGRAM))


@pytest.mark.slow
def test_a_granite_speech_program_writes_transformers_tokens_through_the_stock_runner(
        exported, checkpoint: Path, theirs: Any, tmp_path: Path, capsys) -> None:
    """ExecuTorch's MultimodalRunner (text | Audio | text, then a token at a time) and ``exporters.generate audio=``
    on the program, against transformers' generate on the same frames and tokens; the frames preprocessor.pte makes
    in the runtime are transformers' numpy spectrogram's; a recording past the program's frames is refused."""
    import soundfile
    from executorch.extension.llm.runner import make_audio_input, make_token_input

    from exporters.generate import main
    from exporters.runtime.heard import audio_entry
    from exporters.runtime.programs import register_runtime_kernels

    register_runtime_kernels()
    result = exported("model=hf", f"model.checkpoint={checkpoint}", *PROGRAM)
    m = result.manifest
    audio = m.components["audio"].audio
    assert m.validation.passed and audio.check.passed and audio.check.cosine > 0.9999
    assert audio.check.unquantized.kl_max < 1e-6 and audio.check.unquantized.top1 == 1.0
    assert set(m.methods) == {"decode", "token_embedding", "text_decoder", AUDIO_METHOD}
    constants = m.constant_methods
    assert (constants[FRAME_WINDOW], constants[FRAMES_PER_TOKEN], constants[FRAMES_AXIS], constants[FRAME_RATE]) == (
        15, 5, 1, 50)
    assert constants[AUDIO_TOKEN_ID] == theirs.config.audio_token_id == audio.audio_token_id
    assert audio.audio_token == "<|audio|>" and audio.tokens_per_window == 93 and audio.frames == 465
    # text_decoder computes with the checkpoint's adapter for prompts with audio, the text methods without it
    assert audio.adapter.startswith("speech: LoRA r=4, alpha 8 on 4 layers (q_proj, v_proj)")
    assert constants[TEXT_DECODER_ADAPTER] == "speech" and m.validation.text_decoder_kl is None

    run = result.pte_path.parent
    generator = Generator(result.pte_path)
    made = generator.with_audio("Once upon a time", str(VALIDATION_RECORDING), entry=audio_entry(m))
    features = made.parts[1]
    samples = read_audio(VALIDATION_RECORDING).samples
    np.testing.assert_allclose(features.numpy(), reference_features(samples), atol=1e-4, rtol=0)
    positions = 3 * -(-features.shape[1] // 15)
    before, after = made.parts[0][0].tolist(), made.parts[2][0].tolist()
    assert made.ids == before + [theirs.config.audio_token_id] * positions + after
    ids = torch.tensor([made.ids])
    with torch.no_grad():
        generated = theirs.generate(input_ids=ids, input_features=features, max_new_tokens=NEW_TOKENS,
                                    do_sample=False)
    text = generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), media=made)
    assert text.new_ids == generated[0, ids.shape[1]:].tolist()

    inputs = [make_token_input(before), make_audio_input(features), make_token_input(after)]
    assert stock_runner_text(result.pte_path, inputs, NEW_TOKENS) == text.text
    # A text prompt goes through decode, the base: transformers' greedy tokens without audio (its adapter disabled).
    with torch.no_grad():
        plain = theirs.generate(input_ids=ids[:, :len(before)], max_new_tokens=NEW_TOKENS, do_sample=False)
    written = generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), prompt_ids=before)
    assert written.new_ids == plain[0, len(before):].tolist()

    long = tmp_path / "long.wav"  # 10 s: more than the 465 frames (9.3 s) one call takes
    soundfile.write(long, np.tile(samples, 3)[:160_000], 16_000)
    assert main([str(run), "prompt=hi", f"audio={long}"]) == 2
    assert "is 10.00 s long, and this program takes one recording of 0.03 s to 9.30 s" in capsys.readouterr().err
    bundle, _ = make_bundle(run, tmp_path / "release")
    readme = (bundle / "README.md").read_text()
    assert (bundle / PREPROCESSOR_FILE).is_file() and "[1, T, 160]" in readme and "time-major" in readme
    shutil.rmtree(tmp_path / "release")
