"""A tiny Whisper, built offline by transformers' own classes: the fixture of the speech tests.

A random ``WhisperForConditionalGeneration`` of Whisper's real input shape (80 mel bins, 3000 frames, 1500 audio
positions) and a small decoder, with a byte-level tokenizer holding Whisper's special tokens (two languages, both
tasks, no timestamps), written as faster-whisper ships its models: CTranslate2's ``model.bin`` (float16, the
converter's fused layout), its ``config.json`` (suppressed tokens, language ids) and ``tokenizer.json``. Reading
that folder (``models.ctranslate2``) gives the Hugging Face folder the exports load, so both formats are exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.ctranslate2 import MODEL_FILE, write_model_bin, whisper_arrays

SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
           "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
BYTES = 256  # the byte-level alphabet's ids come first; the special tokens follow
ARCH: dict[str, Any] = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
                        "num_mel_bins": 80, "max_source_positions": 1500, "max_target_positions": 64}


def tokenizer() -> Any:
    """Whisper's byte-level scheme over single bytes (no merges), its special tokens at ids 256 and after."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return tok


def tiny_whisper(seed: int = 0) -> Any:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    ids = {t: BYTES + i for i, t in enumerate(SPECIAL)}
    config = WhisperConfig(vocab_size=BYTES + len(SPECIAL), decoder_start_token_id=ids["<|startoftranscript|>"],
                           eos_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
                           pad_token_id=ids["<|endoftext|>"], **ARCH)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # biases of zero (transformers' init) would leave the conversion's bias handling untested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model


def write_tiny_whisper(folder: Path, seed: int = 0, dtype: Any = np.float16) -> Path:
    """The tiny Whisper as a faster-whisper folder in ``folder``; its weights in ``dtype``, float16 as the real ones."""
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_whisper(seed)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    heads = model.config.decoder_attention_heads
    write_model_bin(folder / MODEL_FILE, whisper_arrays(state, heads, dtype),
                    {"decoder/projection/weight": "decoder/embeddings/weight"})
    tok = tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: BYTES + i for i, t in enumerate(SPECIAL)}
    (folder / "config.json").write_text(json.dumps({
        "alignment_heads": [[1, 0]], "lang_ids": [ids["<|en|>"], ids["<|fr|>"]],
        "suppress_ids": [ids["<|startoflm|>"], ids["<|startofprev|>"], ids["<|nospeech|>"], 0],
        "suppress_ids_begin": [tok.token_to_id("Ġ"), ids["<|endoftext|>"]]}, indent=2) + "\n")
    return folder
