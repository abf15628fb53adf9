"""``python -m exporters.generate <run folder or .pte> prompt="..." [key=value ...]``

Same ``key=value`` style as the exporter; the keys are checked against :class:`GenerateArgs`, so a
typo or a wrong type is an error naming the key.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exporters import console
from exporters.errors import REPORTED_ERRORS, UserError
from exporters.runtime.generator import Generator, SamplingConfig, chat_prompt

USAGE = """usage: python -m exporters.generate <run folder or .pte> prompt="..." [key=value ...]

keys: prompt (required), max_new_tokens=128, temperature=0.0 (greedy), top_p=1.0, seed=0,
      chat=false (apply tokenizer_config.json's chat template), tokenizer=<tokenizer.json>,
      adapter=<name> (a LoRA adapter exported with model.adapters; unset: the base model),
      speculative=auto (draft: the program's draft model proposes tokens, its verify method checks them;
      lookup: propose tokens from the text so far instead; none: one token per call;
      auto: draft when the program has a draft model, else none),
      draft_tokens=<K> (proposals per verify call, 1 to the program's get_draft_tokens; unset: adapted as
      generation goes, more while proposals are kept, fewer when they are not),
      image=<file.png|jpg> (a vision-language program: the picture, resized and normalized by the processor saved
      with the program; repeat image= for several; the prompt marks where each goes, e.g. <image>, or chat=true),
      verbose=false (true: the runtime's own log lines too)
"""


@dataclass
class GenerateArgs:
    prompt: str = "???"
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


def parse(argv: list[str]) -> tuple[str, GenerateArgs]:
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        raise UserError(USAGE)
    images = [a.removeprefix("image=") for a in argv[1:] if a.startswith("image=")]  # repeated: one per image
    rest = [a for a in argv[1:] if not a.startswith("image=")]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(GenerateArgs), OmegaConf.from_dotlist(rest),
                                 {"image": images})
        args = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise UserError(f"{e}\n{USAGE}") from None
    assert isinstance(args, GenerateArgs)
    if not 0 < args.top_p <= 1 or args.temperature < 0 or args.max_new_tokens < 1:
        raise UserError("need 0 < top_p <= 1, temperature >= 0 and max_new_tokens >= 1.")
    return argv[0], args


def main(argv: list[str] | None = None) -> int:
    try:
        path, args = parse(sys.argv[1:] if argv is None else argv)
        console.VERBOSE = args.verbose
        if not args.verbose:
            warnings.simplefilter("ignore")
        with console.native_stderr_to(None):  # the runtime's log lines; the text goes to stdout
            generator = Generator(path, args.tokenizer, args.adapter)
            # A vision-language program's prompt always goes through its processor: an image mark without an image
            # (or the reverse) is refused there.
            images = generator.with_images(args.prompt, args.image, args.chat) if generator.sees_images else None
            prompt = chat_prompt(generator.pte, args.prompt) if args.chat and not images else args.prompt
            ids = images.ids if images else generator.encode(prompt)
            generator.check_fits(ids)
            # a bad value or a program without verify: said before the prompt
            generator.speculation(args.speculative, args.draft_tokens)
            sys.stdout.write(args.prompt if not args.chat else "")
            result = generator.generate(
                prompt, SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed), prompt_ids=ids,
                on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()), speculative=args.speculative,
                draft_tokens=args.draft_tokens, images=images)
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
