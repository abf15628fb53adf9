"""Audio-language checkpoints (Voxtral, Qwen2-Audio; Gemma 4's text decoder, its tower in test_gemma4_audio.py): tiny
ones built by transformers' own classes.

Fast: each family's audio encoder and text decoder against transformers eagerly; each refusal before any work.
Extended (the full suite runs the same path on Gemma 4's program): a Voxtral program with audio_encoder,
token_embedding and text_decoder beside decode_one_token, run by
ExecuTorch's stock MultimodalRunner on the features its own preprocessor.pte makes of the validation recording:
transformers' greedy tokens, token for token; and ``exporters.generate audio=`` on the same program.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from exporters.errors import UserError
from exporters.export import checked_config
from exporters.program.audio import AUDIO_METHOD, AUDIO_TOKEN_ID, AUDIO_TOKENS, MAX_WINDOWS
from exporters.program.speech import PREPROCESSOR_FILE
from exporters.release.bundle import make_bundle
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.validation.speech import VALIDATION_RECORDING
from models.audio_encoder import load_audio_encoder
from models.checkpoint import build_model, open_checkpoint
from models.tiny_alm import TINY_ALM, VOXTRAL_STACK, WINDOW_POSITIONS
from tests.helpers import compose_config, stock_runner_text, transformers_model

FAMILIES = [f for f in TINY_ALM if f != "granite_speech"]  # Granite Speech's decoder: tests/test_granite_speech.py
WINDOWED = ["voxtral", "qwen2_audio"]  # Whisper's encoder on 30 s windows (Gemma 4's tower: tests/test_gemma4_audio.py)
NEW_TOKENS = 8
# The program under test: the MultimodalRunner's three methods and decode_one_token (the fewest graphs to lower), a
# call long enough for one 30 s window of the tiny Voxtral (75 positions).
PROGRAM = ("export.methods=[decode]", "export.layout=split", "export.max_seq_len=96")
TOKENS = {"voxtral": WINDOW_POSITIONS // VOXTRAL_STACK, "qwen2_audio": WINDOW_POSITIONS // 2}


def transformers_embeddings(ref, family: str, features: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' audio embeddings of ``features`` [W, 128, 3000], every window's positions in a row."""
    if family == "voxtral":
        return ref.model.get_audio_features(features).pooler_output
    return ref.model.multi_modal_projector(ref.model.audio_tower(features).last_hidden_state).reshape(
        -1, ref.config.text_config.hidden_size)


@pytest.mark.parametrize("family", WINDOWED)
def test_the_audio_encoder_computes_what_transformers_computes(alm_checkpoint, family: str) -> None:
    """Two 30 s windows (Voxtral's call takes several; Qwen2-Audio's one each): the same embeddings, one row."""
    ckpt = alm_checkpoint(family)
    encoder = load_audio_encoder(str(ckpt), open_checkpoint(ckpt).hf_config)
    features = torch.randn(2, 128, 3000, generator=torch.Generator().manual_seed(0))
    ref = transformers_model(ckpt)
    with torch.no_grad():
        ours = torch.cat([encoder(features)] if family == "voxtral" else [encoder(w[None]) for w in features], dim=1)
        theirs = transformers_embeddings(ref, family, features)
    assert ours.shape == (1, 2 * TOKENS[family], ref.config.text_config.hidden_size)
    torch.testing.assert_close(ours[0], theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_text_decoder_of_an_audio_checkpoint_is_transformers_language_model(alm_checkpoint, family: str) -> None:
    """The decoder is read from the checkpoint's language_model.* tensors alone and computes transformers' logits."""
    ckpt = alm_checkpoint(family)
    ours = build_model(open_checkpoint(ckpt), 64)
    ref = transformers_model(ckpt)
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3]])
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        got = ours(ids, torch.tensor([0]), full_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides,says", [
    (["backend=coreml", "export.layout=split", "export.methods=[prefill,decode]"], "exports fixed-size calls"),
    (["export.max_seq_len=32"], "Set export.max_seq_len=76 or more"),
    (["quant=pt2e_xnnpack_dynamic", "export.max_seq_len=96"], "quant.pt2e=xnnpack_dynamic"),
    (["quant.audio=4bit", "export.max_seq_len=96"], "quant.audio='4bit' is not known"),
])
def test_what_an_audio_language_export_cannot_do_is_refused_before_any_work(alm_checkpoint, overrides: list[str],
                                                                            says: str) -> None:
    with pytest.raises(UserError, match=says.replace(".", r"\.")):
        checked_config(compose_config("model=hf", f"model.checkpoint={alm_checkpoint('voxtral')}", *overrides))


def test_quant_audio_on_a_text_checkpoint_is_refused(tiny_checkpoint) -> None:
    with pytest.raises(UserError, match="quant.audio=8da8w quantizes an audio encoder .* has none"):
        checked_config(compose_config("model=hf", f"model.checkpoint={tiny_checkpoint}", "quant.audio=8da8w"))


@pytest.mark.parametrize("quant,audio,scheme", [("fp32", "auto", "fp32"), ("8da4w", "auto", "8da8w"),
                                               ("8da4w", "fp32", "fp32"), ("fp32", "8da4w", "8da4w")])
def test_quant_audio_auto_quantizes_the_encoder_beside_a_quantized_decoder(alm_checkpoint, quant: str, audio: str,
                                                                           scheme: str) -> None:
    from exporters.quant.audio import audio_scheme

    cfg = checked_config(compose_config("model=hf", f"model.checkpoint={alm_checkpoint('voxtral')}", f"quant={quant}",
                                        f"quant.audio={audio}", "export.max_seq_len=96"))
    assert audio_scheme(cfg.quant) == scheme


def program_features(run: Path) -> torch.Tensor:
    """The validation recording through the run's preprocessor.pte, as an app makes audio_encoder's input."""
    from exporters.runtime.audio import read_audio
    from exporters.runtime.programs import LoadedProgram

    samples = torch.from_numpy(read_audio(VALIDATION_RECORDING).samples)
    return LoadedProgram(run / PREPROCESSOR_FILE).run("forward", samples)[0]


@pytest.mark.slow
# The stock runner's audio path and its refusals run on Gemma 4's program in the full suite (test_gemma4_audio.py), and
# Whisper's encoder kernels on the speech programs (test_speech.py): these are Voxtral's windows on top of them.
@pytest.mark.extended
def test_the_stock_multimodal_runner_writes_transformers_tokens_with_audio(exported, alm_checkpoint,
                                                                           tmp_path: Path) -> None:
    """ExecuTorch's MultimodalRunner (text | Audio | text, then a token at a time through token_embedding and
    text_decoder) on the program, against transformers' generate on the same features and tokens; exporters.generate
    audio= (preprocessor.pte, our driver) writes the same text."""
    import transformers
    from executorch.extension.llm.runner import make_audio_input, make_token_input

    from exporters.runtime.heard import audio_entry
    from exporters.runtime.programs import register_runtime_kernels

    register_runtime_kernels()
    ckpt = alm_checkpoint("voxtral")
    result = exported("model=hf", f"model.checkpoint={ckpt}", *PROGRAM)
    m = result.manifest
    assert m.validation.passed and m.validation.text_decoder_kl < 1e-9
    audio = m.components["audio"].audio
    assert audio.check.passed and audio.check.cosine > 0.9999 and audio.check.greedy_tokens == audio.check.eager_choices
    assert audio.check.unquantized.kl_max < 1e-6 and audio.check.unquantized.top1 == 1.0
    assert set(m.methods) == {"decode", "token_embedding", "text_decoder", AUDIO_METHOD}
    assert m.methods[AUDIO_METHOD].inputs[0].shape == [1, 128, 3000]  # one window a call at this length
    assert m.methods[AUDIO_METHOD].delegated_partitions == 1  # the whole tower and projector in one partition
    config = transformers.AutoConfig.from_pretrained(ckpt)
    assert m.constant_methods[AUDIO_TOKENS] == TOKENS["voxtral"] and m.constant_methods[MAX_WINDOWS] == 1
    assert m.constant_methods[AUDIO_TOKEN_ID] == config.audio_token_id == audio.audio_token_id
    assert audio.audio_token == "[AUDIO]" and audio.preprocessor == PREPROCESSOR_FILE
    run = result.pte_path.parent
    assert (run / PREPROCESSOR_FILE).is_file() and PREPROCESSOR_FILE in m.files
    # Each weight stored once: the decoder's (decode and text_decoder; the table read by decode and token_embedding)
    # and the encoder's, all fp32.
    stored = m.program.storage["named_data_bytes"] + m.program.storage["constant_buffer_bytes"]
    weights = 4 * (m.model.parameters + m.components["audio"].parameters)
    assert weights * 0.95 < stored < weights * 1.1, (stored, weights)

    generator = Generator(result.pte_path)
    made = generator.with_audio("Once upon a time", str(VALIDATION_RECORDING), entry=audio_entry(m))
    features = program_features(run)
    assert made.parts[0].shape == (1, 1) and torch.equal(made.parts[1], features)  # BOS, the audio, then the text
    before, after = made.parts[0][0].tolist(), made.parts[2][0].tolist()
    ids = torch.tensor([made.ids])
    assert made.ids == before + [config.audio_token_id] * TOKENS["voxtral"] + after
    with torch.no_grad():
        generated = transformers_model(ckpt).generate(input_ids=ids, input_features=features,
                                                    max_new_tokens=NEW_TOKENS, do_sample=False)
    expected_ids = generated[0, ids.shape[1]:].tolist()
    text = generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), media=made)
    assert text.new_ids == expected_ids

    inputs = [make_token_input(before), make_audio_input(features), make_token_input(after)]
    assert stock_runner_text(result.pte_path, inputs, NEW_TOKENS) == text.text
    # A release bundle carries the preprocessor and says how an app feeds audio.
    bundle, _ = make_bundle(run, tmp_path / "release")
    assert (bundle / PREPROCESSOR_FILE).is_file() and "## Audio" in (bundle / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.extended  # as above: the same refusals on Gemma 4's program in the full suite, beside this one's windows
def test_generate_refuses_audio_the_program_cannot_take(exported, alm_checkpoint, tmp_path: Path, capsys) -> None:
    """Each refusal is one paragraph, before any method runs: a recording longer than the program's windows, the
    audio token written twice, a file that is not audio, audio to a text program."""
    from exporters.generate import main

    ckpt = alm_checkpoint("voxtral")
    run = exported("model=hf", f"model.checkpoint={ckpt}", *PROGRAM).pte_path.parent
    import numpy as np
    import soundfile

    long = tmp_path / "long.wav"
    soundfile.write(long, (0.1 * np.sin(np.arange(16_000 * 31) / 20)).astype(np.float32), 16_000)
    noise = tmp_path / "noise.wav"
    noise.write_bytes(b"not audio at all")
    cases = [(["prompt=hi", f"audio={long}"], "is 31.0 s long, 2 windows of 30 s"),
             (["prompt=[AUDIO] and [AUDIO]", f"audio={VALIDATION_RECORDING}"], "marks the audio 2 times"),
             (["prompt=hi", f"audio={noise}"], "cannot be read as audio")]
    for args, says in cases:
        assert main([str(run), *args]) == 2
        assert says in capsys.readouterr().err
    shutil.copy(VALIDATION_RECORDING, tmp_path / "speech.wav")
    text_run = exported("export.methods=[forward]").pte_path.parent
    assert main([str(text_run), "prompt=hi", f"audio={tmp_path / 'speech.wav'}"]) == 2
    assert "needs a speech or audio-language program" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.extended  # the Voxtral program above runs the same methods and kernels; this is Qwen2-Audio's wrapper
def test_a_qwen2_audio_program_writes_transformers_tokens_on_a_whole_window(exported, alm_checkpoint) -> None:
    """Qwen2-Audio's program encodes one padded 30 s window whole (750 positions): transformers' greedy tokens on the
    same features with every frame counted (feature_attention_mask of ones), token for token."""
    from exporters.runtime.heard import audio_entry

    ckpt = alm_checkpoint("qwen2_audio")
    result = exported("model=hf", f"model.checkpoint={ckpt}", "export.methods=[decode]", "export.layout=split",
                      "export.max_seq_len=768", "export.max_context_len=800")
    m = result.manifest
    audio = m.components["audio"].audio
    assert m.validation.passed and audio.check.passed and audio.tokens_per_window == TOKENS["qwen2_audio"]
    generator = Generator(result.pte_path)
    made = generator.with_audio("Once upon a time", str(VALIDATION_RECORDING), entry=audio_entry(m))
    features = made.parts[1]
    ids = torch.tensor([made.ids])
    with torch.no_grad():
        generated = transformers_model(ckpt).generate(input_ids=ids, input_features=features,
                                                    feature_attention_mask=torch.ones(1, 3000, dtype=torch.long),
                                                    max_new_tokens=NEW_TOKENS, do_sample=False)
    ours = generator.generate("", SamplingConfig(NEW_TOKENS, 0.0, 1.0, 0), media=made)
    assert ours.new_ids == generated[0, ids.shape[1]:].tolist()
