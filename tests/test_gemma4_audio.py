"""Gemma 4's audio tower (models.gemma4_audio) against transformers on a tiny random checkpoint of every modality
(models.tiny_alm): the embeddings and their count for recordings of every length modulo the tower's four frames a
position, the log-mel frames against transformers' feature extractor, the method captured with any frame count; and
the program of every modality run by ExecuTorch's stock MultimodalRunner against transformers' generate."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import soundfile
import pytest
import torch
from torch.nn import functional as F
from transformers import (AutoConfig, AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4ForConditionalGeneration,
                          Gemma4Processor)

from models.decoder import ids_of_digits
from models.gemma4_audio import (FRAMES_PER_TOKEN, SAMPLE_RATE, Gemma4LogMel, audio_positions, load_gemma4_audio,
                                 padded_frames)
from tests.helpers import GEMMA4_PROGRAM, gemma4_program_overrides, stock_runner_text

# Samples whose valid frames are 0, 1, 2 and 3 modulo 4 (16,000 / 160 = 100 frames a second), and a recording too
# short for one of the tower's attention blocks (0.3 s).
LENGTHS = (16_000, 16_160, 16_320, 16_480, 4_800)


@pytest.fixture(scope="module")
def checkpoint(alm_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return alm_checkpoint("gemma4")


@pytest.fixture(scope="module")
def theirs(checkpoint: Path) -> Gemma4ForConditionalGeneration:
    return Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> torch.nn.Module:
    return load_gemma4_audio(str(checkpoint), AutoConfig.from_pretrained(checkpoint))


def _speech(samples: int, seed: int = 0) -> np.ndarray:
    """A voiced-like signal: harmonics of a wandering pitch with noise (log-mel frames far from zero)."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / SAMPLE_RATE
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * 0.1 + 0.01 * rng.standard_normal(samples)
    return wave.astype(np.float32)


def _extracted(samples: int) -> Any:
    """transformers' feature extractor on one recording: frames padded as it pads them, and their mask."""
    return Gemma4AudioFeatureExtractor()([_speech(samples)], sampling_rate=SAMPLE_RATE, return_tensors="pt")


def _features(samples: int, extracted: Any = None) -> tuple[torch.Tensor, int]:
    """The recording's valid frames as transformers' feature extractor computes them (``extracted``, if it ran
    already), and their count."""
    out = _extracted(samples) if extracted is None else extracted
    valid = int(out["input_features_mask"].sum())
    return out["input_features"][:, :valid], valid


def _program_input(features: torch.Tensor) -> torch.Tensor:
    """``[1, frames, bins]`` as the method takes them: zeros up to a multiple of 4 frames, bins first."""
    frames = features.shape[1]
    return F.pad(features, (0, 0, 0, padded_frames(frames) - frames)).transpose(1, 2).contiguous()


@pytest.mark.parametrize("samples", LENGTHS)
def test_gemma4s_audio_encoder_computes_what_transformers_computes(samples: int, theirs: Any, ours: Any) -> None:
    extracted = _extracted(samples)
    features, valid = _features(samples, extracted)
    with torch.no_grad():  # transformers on what its feature extractor gives, padding and mask
        reference = theirs.model.get_audio_features(extracted["input_features"], extracted["input_features_mask"])
        expected = reference.pooler_output[reference.attention_mask]  # the masked positions stripped
        got = ours(_program_input(features))
    counted = Gemma4Processor._compute_audio_num_tokens(  # the prompt's audio tokens, as the processor counts them
        SimpleNamespace(feature_extractor=Gemma4AudioFeatureExtractor(), audio_seq_length=750), _speech(samples),
        SAMPLE_RATE)
    assert got.shape[1] == expected.shape[0] == audio_positions(valid) == counted
    hidden = expected.shape[-1]
    torch.testing.assert_close(got[0, :, :hidden], expected, rtol=1e-5, atol=1e-5)
    assert bool((ids_of_digits(got[..., hidden:]) == theirs.config.audio_token_id).all())


@pytest.mark.parametrize("samples", LENGTHS[:2])
def test_gemma4s_log_mel_frames_are_the_feature_extractors(samples: int) -> None:
    features, valid = _features(samples)
    with torch.no_grad():
        frames = Gemma4LogMel()(torch.from_numpy(_speech(samples)))
    assert frames.shape == (1, 128, padded_frames(valid))
    torch.testing.assert_close(frames[0, :, :valid], features[0].T, rtol=1e-4, atol=1e-4)
    assert not frames[0, :, valid:].any()  # the padding the encoder masks


def test_gemma4s_audio_encoder_captures_once_for_every_length(ours: Any) -> None:
    inputs = {samples: _program_input(_features(samples)[0]) for samples in (16_000, 16_480, 4_800)}
    frames = FRAMES_PER_TOKEN * torch.export.Dim("positions", min=1, max=750)
    with torch.no_grad():
        program = torch.export.export(ours, (inputs[16_000],), dynamic_shapes=({2: frames},), strict=False)
        for x in inputs.values():
            torch.testing.assert_close(program.module()(x), ours(x), rtol=1e-5, atol=1e-5)


@pytest.mark.extended
def test_gemma4s_audio_encoder_runs_in_the_runtime_for_every_length(ours: Any, tmp_path: Path) -> None:
    """Lowered to XNNPACK once, run by ExecuTorch's runtime on three recordings of different lengths."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    inputs = {samples: _program_input(_features(samples)[0]) for samples in (16_000, 16_480, 4_800)}
    frames = FRAMES_PER_TOKEN * torch.export.Dim("positions", min=1, max=750)
    with torch.no_grad():
        program = torch.export.export(ours, (inputs[16_000],), dynamic_shapes=({2: frames},), strict=False)
    path = tmp_path / "audio_encoder.pte"
    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    method = Runtime.get().load_program(path).load_method("forward")
    for x in inputs.values():
        with torch.no_grad():
            expected = ours(x)
        torch.testing.assert_close(method.execute([x])[0], expected, rtol=1e-4, atol=1e-4)


# The program under test (tests.helpers.gemma4_program_overrides, shared with three other tests): the
# MultimodalRunner's methods and decode_one_token, with the assistant's; one text_decoder call long enough for the
# validation recording (4.9 s: 122 positions) and a prompt with an image around it.
MOST = 191  # the positions one call takes: a recording of 7.64 s at most
NEW_TOKENS = 8


@pytest.mark.slow
def test_a_gemma4_program_of_every_modality_writes_transformers_tokens_through_the_stock_runner(
        exported, checkpoint: Path, gemma4_assistant, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Gemma 4 with its image and audio towers as one program (vision_encoder, audio_encoder, token_embedding,
    text_decoder), each encoder validated. A recording's positions between <|audio> and <audio|>, fed by ExecuTorch's
    stock MultimodalRunner (text | Audio | text) and by exporters.generate audio= on the frames preprocessor.pte
    makes, then a prompt with an image *and* the recording through the stock runner and exporters.generate (image=
    and audio=): transformers' greedy tokens on the same pixels, frames and mask, token for token. The audio method takes any recording up to its most positions
    (the whole range kept through lowering); a longer one, the audio token written twice, a file that is not audio,
    audio to a text program: each refused in one paragraph before anything runs."""
    from executorch.extension.llm.runner import make_audio_input, make_image_input, make_token_input
    from executorch.runtime import Runtime
    from PIL import Image

    from exporters.generate import main
    from exporters.program.audio import AUDIO_BEGIN_ID, AUDIO_END_ID, AUDIO_METHOD, AUDIO_TOKENS
    from exporters.program.audio import FRAMES_PER_TOKEN as FRAMES_CONSTANT
    from exporters.program.speech import PREPROCESSOR_FILE
    from exporters.program.vision import VISION_METHOD, program_pixels
    from exporters.release.bundle import make_bundle
    from exporters.runtime.audio import read_audio
    from exporters.runtime.generator import Generator, SamplingConfig
    from exporters.runtime.heard import audio_entry
    from exporters.runtime.programs import register_runtime_kernels
    from exporters.validation.speech import VALIDATION_RECORDING
    from models.vision import load_processor
    from tests.helpers import transformers_model

    register_runtime_kernels()
    result = exported(*gemma4_program_overrides(checkpoint, gemma4_assistant))
    m, run = result.manifest, result.pte_path.parent
    audio, vision = m.components["audio"].audio, m.components["vision"].vision
    assert m.validation.passed and audio.check.passed and vision.check.passed and audio.check.cosine > 0.9999
    assert audio.check.greedy_tokens == audio.check.eager_choices and audio.check.unquantized.top1 == 1.0
    assert set(m.methods) == {"decode", "verify", "draft_propose", "token_embedding", "text_decoder", VISION_METHOD,
                              AUDIO_METHOD}
    config = AutoConfig.from_pretrained(checkpoint)
    constants = m.constant_methods
    assert constants[AUDIO_TOKENS] == MOST and constants[FRAMES_CONSTANT] == FRAMES_PER_TOKEN
    assert (constants[AUDIO_BEGIN_ID], constants[AUDIO_END_ID]) == (config.boa_token_id, config.eoa_token_index)
    assert (audio.begin_token, audio.audio_token, audio.end_token) == ("<|audio>", "<|audio|>", "<audio|>")
    # Memory planned for the most positions: torch's fake convolution no longer narrows the range to short audio.
    planned = Runtime.get().load_program(result.pte_path).load_method(AUDIO_METHOD).metadata.input_tensor_meta(0)
    assert list(planned.sizes()) == [1, 128, FRAMES_PER_TOKEN * MOST]

    generator = Generator(result.pte_path)
    made = generator.with_audio("Once upon a time", str(VALIDATION_RECORDING), entry=audio_entry(m))
    frames = made.parts[1]
    positions = frames.shape[-1] // FRAMES_PER_TOKEN
    with torch.no_grad():  # preprocessor.pte against the same log-mel in PyTorch (ExecuTorch's own module)
        expected_frames = Gemma4LogMel()(torch.from_numpy(read_audio(VALIDATION_RECORDING).samples))
    torch.testing.assert_close(frames, expected_frames, rtol=1e-4, atol=1e-4)
    before, after = made.parts[0][0].tolist(), made.parts[2][0].tolist()
    assert before[-1] == config.boa_token_id and after[0] == config.eoa_token_index
    assert made.ids == before + [config.audio_token_id] * positions + after and positions == 122
    ids = torch.tensor([made.ids])
    reference = transformers_model(checkpoint)
    heard = {"input_features": frames.transpose(1, 2), "input_features_mask": frames[0].any(0)[None]}
    with torch.no_grad():  # transformers on the same frames, [1, frames, bins], with the recording's frames marked
        generated = reference.generate(input_ids=ids, **heard, max_new_tokens=NEW_TOKENS, do_sample=False)
    ours = generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), media=made)
    assert ours.new_ids == generated[0, ids.shape[1]:].tolist()

    def stock(inputs: list) -> str:  # type: ignore[type-arg]
        return stock_runner_text(result.pte_path, inputs, NEW_TOKENS)

    assert stock([make_token_input(before), make_audio_input(frames), make_token_input(after)]) == ours.text

    # An image, then the recording, in one prompt: the processor's image tokens (begin, 4, end), then the audio's.
    picture = Image.fromarray((np.random.RandomState(0).rand(40, 50, 3) * 255).astype("uint8"))
    seen = load_processor(checkpoint)(images=picture, text="Once upon <|image|> a time", return_tensors="pt")
    image_ids = seen["input_ids"][0].tolist()
    at = image_ids.index(config.eoi_token_id)
    ids = torch.tensor([image_ids + before[1:] + [config.audio_token_id] * positions + after])  # before[0]: BOS
    pixels = {k: v for k, v in seen.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        generated = reference.generate(input_ids=ids, **pixels, **heard, max_new_tokens=NEW_TOKENS, do_sample=False)
    first_image = image_ids.index(config.image_token_id)
    text = stock([make_token_input(image_ids[:first_image]), make_image_input(program_pixels(seen, vision.image_size)),
                  make_token_input(image_ids[at:] + before[1:]), make_audio_input(frames), make_token_input(after)])
    assert text == AutoTokenizer.from_pretrained(checkpoint).decode(generated[0, ids.shape[1]:])
    # The same prompt written once, image= and audio= through exporters.generate: the same ids, the same text.
    picture_file, prompt = tmp_path / "picture.png", "Once upon <|image|> a time<|audio|>Once upon a time"
    picture.save(picture_file)
    both = generator.with_audio(prompt, str(VALIDATION_RECORDING), entry=audio_entry(m), images=[str(picture_file)])
    assert both.ids == ids[0].tolist() and both.encoders == (VISION_METHOD, AUDIO_METHOD)
    assert main([str(run), f"prompt={prompt}", f"image={picture_file}", f"audio={VALIDATION_RECORDING}",
                 f"max_new_tokens={NEW_TOKENS}", "temperature=0"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == prompt + text

    long, noise = tmp_path / "long.wav", tmp_path / "noise.wav"
    text_run = exported("export.methods=[forward]").pte_path.parent  # a text program tests/test_run_and_ship.py exports
    soundfile.write(long, _speech(16_000 * 8), SAMPLE_RATE)
    noise.write_bytes(b"not audio at all")
    for args, says in ((["prompt=hi", f"audio={long}"],
                        "is 8.00 s long, and this program takes one recording of 0.03 s to 7.64 s"),
                       (["prompt=<|audio|> and <|audio|>", f"audio={VALIDATION_RECORDING}"], "marks the audio 2 times"),
                       (["prompt=hi", f"audio={noise}"], "cannot be read as audio"),
                       (["prompt=<|image|> and <|image|>", f"image={picture_file}", f"audio={VALIDATION_RECORDING}"],
                        "marks 2 image(s) with '<|image|>' and 1 image(s) are given")):
        assert main([str(run), *args]) == 2  # one paragraph, before any method runs
        assert says in capsys.readouterr().err
    assert main([str(text_run), "prompt=hi", f"audio={VALIDATION_RECORDING}"]) == 2
    assert "needs a speech or audio-language program" in capsys.readouterr().err
    bundle, _ = make_bundle(run, tmp_path / "release")
    readme = (bundle / "README.md").read_text()
    assert (bundle / PREPROCESSOR_FILE).is_file() and "`<|audio>`" in readme and "`<audio|>`" in readme


@pytest.mark.slow
@pytest.mark.extended  # the full suite lowers the same tower in fp32 above; this is 8da8w's quantized activations
def test_a_quantized_gemma4_program_of_every_modality_lowers_and_passes_validation(exported, checkpoint: Path) -> None:
    """quant=8da4w (both encoders 8da8w by quant.*=auto): each encoder's method lowered to XNNPACK and validated
    against its eager quantized model. A dynamically quantized activation shared by two of the audio tower's linears
    once made two partitions a dependency cycle that to_backend refused (capture now shares them in the decoder's
    methods only)."""
    result = exported("model=hf", f"model.checkpoint={checkpoint}", "quant=8da4w", *GEMMA4_PROGRAM)
    m = result.manifest
    audio, vision = m.components["audio"].audio, m.components["vision"].vision
    assert m.validation.passed and audio.check.passed and vision.check.passed
    assert audio.quantization.startswith("8da8w") and m.methods["audio_encoder"].delegated_partitions > 1
