"""``python -m exporters.generate <run folder or .pte> prompt="..." [key=value ...]``

Same ``key=value`` style as the exporter; the keys are checked against :class:`GenerateArgs`, so a
typo or a wrong type is an error naming the key. The prompt is text, never parsed: everything after
``prompt=`` as it is (colons, ``#``, ``${...}``, new lines), or a file's (``prompt_file=``), or standard input
(``prompt=-``). What the program can answer without its weights (its methods, the images' files, the
prompt's length) is checked before they are loaded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, TextIO

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exporters import console
from exporters.errors import REPORTED_ERRORS, UserError
from exporters.manifest import MANIFEST_FILE, Manifest, SpeechEntry
from exporters.runtime.constraint import Constraint
from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt, resolve_program
from exporters.runtime.audio import read_audio
from exporters.runtime.heard import audio_entry
from exporters.runtime.transcriber import Transcriber, speech_entry

USAGE = """usage: python -m exporters.generate <run folder or .pte> prompt="..." [key=value ...]

keys: prompt=<text> (taken as written: everything after the first =), or prompt_file=<path> (a UTF-8 file), or
      prompt=- (standard input): one of them is required;
      max_new_tokens=128, temperature=0.0 (greedy), top_p=1.0, seed=0,
      chat=false (apply tokenizer_config.json's chat template), tokenizer=<tokenizer.json>,
      adapter=<name | file.ptd | PEFT folder> (a LoRA adapter exported with model.adapters, by name; of a
      swappable program, also a .ptd file or a PEFT folder that fits its slots; unset: the base model),
      speculative=auto (draft: the program's draft model proposes tokens, its verify method checks them;
      lookup: propose tokens from the text so far instead; none: one token per call;
      auto: draft when the program has a draft model, else none),
      draft_tokens=<K> (proposals per verify call, 1 to the program's get_draft_tokens; unset: adapted as
      generation goes, more while proposals are kept, fewer when they are not),
      image=<file.png|jpg> (a vision-language program: the picture, resized and normalized by the processor saved
      with the program; repeat image= for several; the prompt marks where each goes, e.g. <image>, or chat=true),
      audio=<file.wav|flac|ogg|mp3> (a speech program: the recording to transcribe, no prompt; longer than 30 s
      in consecutive windows; an audio-language program: the recording the prompt is about, where the prompt
      writes the audio token, e.g. [AUDIO], else before the text, or chat=true; with image= too where the
      program also sees, e.g. Gemma 4; any sample rate or channel count, converted to 16 kHz mono),
      language=auto (a speech program: the spoken language's code, e.g. en, or auto: detected),
      task=transcribe (a speech program: transcribe, or translate into English),
      json_schema=<file.json> (the answer constrained to that JSON schema: it parses and validates; one token
      per call, without speculation),
      verbose=false (true: the runtime's own log lines too)
"""


@dataclass
class GenerateArgs:
    prompt: str = ""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False
    tokenizer: Optional[str] = None
    adapter: Optional[str] = None
    speculative: str = "auto"
    draft_tokens: Optional[int] = None
    verbose: bool = False
    image: List[str] = field(default_factory=list)
    audio: Optional[str] = None
    language: str = "auto"
    task: str = "transcribe"
    json_schema: Optional[str] = None


#: Keys whose values are taken as written, never read as YAML: text and file paths (a path may hold ``:`` or ``#``).
VERBATIM = ("prompt", "prompt_file", "image", "tokenizer", "adapter", "audio", "json_schema")


def parse(argv: list[str], stdin: TextIO | None = None) -> tuple[str, GenerateArgs]:
    """The program's path and the checked arguments; ``stdin``: where ``prompt=-`` reads (default: sys.stdin)."""
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        raise UserError(USAGE)
    verbatim: dict[str, list[str]] = {key: [] for key in VERBATIM}
    rest = []
    for arg in argv[1:]:
        key, _, value = arg.partition("=")
        if key in verbatim and "=" in arg:
            verbatim[key].append(value)  # image= is repeated, one per image
        else:
            rest.append(arg)
    try:  # first: a mistyped key (promt=) is named as such, not taken for a missing prompt
        args = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GenerateArgs), OmegaConf.from_dotlist(rest)))
    except OmegaConfBaseException as e:
        raise UserError(f"{e}\n{USAGE}") from None
    assert isinstance(args, GenerateArgs)
    once = {key: values[0] for key, values in verbatim.items() if key != "image" and _once(key, values)}
    given = (once.pop("prompt", None), once.pop("prompt_file", None))
    if "audio" in once and given == (None, None):  # a recording alone: transcribed by a speech program
        return argv[0], dataclasses.replace(args, image=verbatim["image"], **once)
    prompt = _prompt(*given, stdin or sys.stdin)
    # Set after OmegaConf, which would read ${...} in them as interpolations.
    args = dataclasses.replace(args, prompt=prompt, image=verbatim["image"], **once)
    if not 0 < args.top_p <= 1 or args.temperature < 0 or args.max_new_tokens < 1:
        raise UserError("need 0 < top_p <= 1, temperature >= 0 and max_new_tokens >= 1.")
    return argv[0], args


def _once(key: str, values: list[str]) -> bool:
    if len(values) > 1:
        raise UserError(f"{key}= is given {len(values)} times: give it once.\n{USAGE}")
    return bool(values)


def _prompt(text: str | None, file: str | None, stdin: TextIO) -> str:
    """The prompt, exactly as given: ``prompt=<text>``, ``prompt_file=<path>`` or ``prompt=-`` (standard input)."""
    if text is not None and file is not None:
        raise UserError("prompt= and prompt_file= are both given: give one (prompt=- reads standard input).")
    if file is not None:
        try:
            return Path(file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"prompt_file={file}: cannot be read as UTF-8 text ({e}). Give a readable text file, "
                            "or the prompt itself with prompt=<text> (or prompt=- for standard input).") from None
    if text == "-":
        return stdin.read()
    if text is None:
        raise UserError(f"no prompt: give prompt=<text>, prompt_file=<path> or prompt=- (standard input).\n{USAGE}")
    return text


def constraint_of(generator: Generator, args: GenerateArgs) -> Constraint | None:
    """``json_schema=<file>``'s grammar, checked before the weights are loaded; refused beside a speculation it
    would turn off."""
    if args.json_schema is None:
        return None
    if args.speculative in ("draft", "lookup"):
        raise UserError(f"json_schema= chooses one token per call and speculative={args.speculative} proposes several: "
                        "leave speculative out (auto) or set speculative=none.")
    try:
        schema = json.loads(Path(args.json_schema).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"json_schema={args.json_schema}: cannot be read as a JSON file ({e}). Give a file holding "
                        'a JSON schema, e.g. {"type": "object", "properties": {...}}.') from None
    return generator.grammars.json_schema(schema)


def transcribe(pte: Path, entry: SpeechEntry, args: GenerateArgs) -> int:
    """``audio=`` to a speech program: the recording's transcript on stdout, the numbers on stderr."""
    assert args.audio is not None
    if args.prompt:
        raise UserError("audio= with a prompt: a speech program transcribes the recording and takes no prompt. "
                        "Leave prompt= (and prompt_file=) out.")
    if args.image:
        raise UserError(f"image= on a speech program: {pte.parent} transcribes audio and takes no image. Leave image out.")
    recording = read_audio(args.audio)  # checked before the program is loaded
    for conversion in recording.conversions:
        print(f"[audio: {conversion}]", file=sys.stderr)
    with console.native_stderr_to(None):
        transcriber = Transcriber(pte.parent, entry, pte)
        transcriber.check(args.language, args.task)
        result = transcriber.transcribe(recording, args.language, args.task, args.max_new_tokens)
    print(result.text.strip())
    print(f"\n[loaded {pte.name} + {entry.preprocessor} in {transcriber.load_seconds:.2f} s; "
          f"{result.seconds:.1f} s of audio in {result.windows} window(s), language {result.language or 'en'}; "
          f"features {result.preprocess_s:.2f} s, encoder {result.encode_s:.2f} s, {len(result.tokens)} tokens at "
          f"{result.tokens_per_s:.1f} tok/s; real-time factor {result.real_time_factor:.3f}]", file=sys.stderr)
    return 0


def run_of(path: str) -> tuple[Path, Manifest | None]:
    """The program (``path``: a run folder or its .pte) and its run folder's manifest, if it has one."""
    pte = resolve_program(path)
    return pte, Manifest.read(pte.parent) if (pte.parent / MANIFEST_FILE).is_file() else None


def main(argv: list[str] | None = None) -> int:
    try:
        path, args = parse(sys.argv[1:] if argv is None else argv)
        console.set_verbose(args.verbose)
        pte, manifest = run_of(path)
        speech = speech_entry(manifest) if manifest is not None else None
        if speech is not None and args.audio is not None:
            return transcribe(pte, speech, args)
        if speech is not None:
            raise UserError(f"{path} is a speech program: it transcribes audio=<file> and takes no prompt.")
        with console.native_stderr_to(None):  # the runtime's log lines; the text goes to stdout
            # Everything the program can answer without its weights is checked before they are loaded.
            generator = Generator(path, args.tokenizer, args.adapter, load=False)
            generator.check_speculation(args.speculative, args.draft_tokens)
            constraint = constraint_of(generator, args)
            # A vision-language program's prompt always goes through its processor: an image mark without an image
            # (or the reverse) is refused there, as image= on a program that takes none.
            media = (generator.with_audio(args.prompt, args.audio, args.chat, audio_entry(manifest), args.image)
                     if args.audio is not None else generator.with_images(args.prompt, args.image, args.chat)
                     if generator.sees_images or args.image else None)
            prompt = chat_prompt(generator.pte, args.prompt) if args.chat and not media else args.prompt
            ids = media.ids if media else generator.encode(prompt)
            generator.check_fits(ids)
            generator.load()
            sys.stdout.write(args.prompt if not args.chat else "")
            result = generator.generate(
                prompt, SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed), prompt_ids=ids,
                on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()), speculative=args.speculative,
                draft_tokens=args.draft_tokens, media=media, constraint=constraint)
    except REPORTED_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loaded = " + ".join([generator.pte.name, *(p.name for p in generator.program.data_paths)]) + (
        f", adapter {args.adapter}" if args.adapter else "")
    print(f"\n\n[loaded {loaded} in {generator.load_seconds:.2f} s; "
          f"prompt {len(result.prompt_ids)} tokens at {result.prompt_tokens_per_s:.1f} tok/s; "
          f"generated {len(result.new_ids)} tokens at {result.generation_tokens_per_s:.1f} tok/s; "
          + (f"{result.speculation.describe()}; " if result.speculation else "")
          + f"stopped: {result.stop_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
