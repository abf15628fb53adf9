"""The checkpoint's tokenizer: ``tokenizer.json`` (Hugging Face tokenizers) or ``tokenizer.model``
(SentencePiece, as Llama 2, TinyLlama, Mistral and Gemma ship it).

Both file kinds are what ExecuTorch's stock runner reads too, so the files copied next to the
``.pte`` are the ones validation and ``exporters.generate`` used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from models.errors import ModelError

# In order of preference when a directory holds both.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Where transformers 5 saves a chat template (older checkpoints keep it inside tokenizer_config.json).
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def vocabulary(self) -> dict[str, int]: ...

    def special_ids(self) -> list[int]: ...


class HuggingFaceTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token (special ones included) -> its id."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def special_ids(self) -> list[int]:
        """The added tokens (end of text, chat turns, tool calls): not learnt by merges, ranked by nothing."""
        return sorted(self._tok.get_added_tokens_decoder())


class SentencePieceTokenizer:
    def __init__(self, path: Path) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ModelError(
                f"{path}: not a SentencePiece model ({e}). Llama 3's original tiktoken-format tokenizer.model is "
                "not read here: use the checkpoint's tokenizer.json instead."
            ) from e

    def encode(self, text: str) -> list[int]:
        return list(self._sp.Encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._sp.Decode(ids)  # control tokens (bos/eos) decode to nothing

    def vocabulary(self) -> dict[str, int]:
        return {self._sp.IdToPiece(i): i for i in range(self._sp.GetPieceSize())}

    def special_ids(self) -> list[int]:
        """Control tokens (bos, eos, chat turns)."""
        return [i for i in range(self._sp.GetPieceSize()) if self._sp.IsControl(i)]


LOADERS = {".json": HuggingFaceTokenizer, ".model": SentencePieceTokenizer}


def find_tokenizer(directory: Path) -> Path | None:
    """The preferred tokenizer file in ``directory``, or None."""
    return next((directory / n for n in TOKENIZER_FILES if (directory / n).is_file()), None)


def load_tokenizer(path: Path) -> TextTokenizer:
    """A tokenizer from ``tokenizer.json`` or a SentencePiece ``tokenizer.model``."""
    loader = LOADERS.get(path.suffix)
    if loader is None or not path.is_file():
        raise ModelError(
            f"{path}: no tokenizer there. Give a tokenizer.json (Hugging Face tokenizers) or a SentencePiece "
            "tokenizer.model."
        )
    return loader(path)
