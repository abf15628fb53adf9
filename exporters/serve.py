"""``python -m exporters.serve <run folder | bundle | .pte> [host=127.0.0.1] [port=8000] [key=value ...]``

An OpenAI-compatible server over one exported program, loaded once: ``GET /v1/models``, ``POST
/v1/chat/completions`` (the chat template the export bundled) and ``POST /v1/completions``, streamed or not.
Loopback only unless ``host=`` says otherwise. docs/serving.md says what it answers and what it refuses.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exporters import console
from exporters.errors import REPORTED_ERRORS, UserError
from exporters.runtime.speculative import SPECULATIVE

USAGE = """usage: python -m exporters.serve <run folder | bundle | .pte> [key=value ...]

keys: host=127.0.0.1 (loopback only; 0.0.0.0 serves every interface), port=8000,
      api_key=<key> (unset: none; set: every request sends Authorization: Bearer <key>),
      max_tokens=<n> (the most tokens one request may generate, and the default; unset: the program's cache),
      max_queue=8 (requests waiting beside the one running; more are refused with 429 and Retry-After),
      max_request_bytes=1000000, speculative=auto (as exporters.generate: draft, lookup, none),
      name=<model id> (unset: the run folder's name), tokenizer=<tokenizer.json>,
      verbose=false (true: the runtime's and uvicorn's own log lines too)
"""


@dataclass
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_tokens: Optional[int] = None
    max_queue: int = 8
    max_request_bytes: int = 1_000_000
    speculative: str = "auto"
    name: Optional[str] = None
    tokenizer: Optional[str] = None
    verbose: bool = False


def parse(argv: list[str]) -> tuple[str, ServeArgs]:
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        raise UserError(USAGE)
    verbatim = {k: v for k, _, v in (a.partition("=") for a in argv[1:]) if k in ("api_key", "name", "tokenizer")}
    rest = [a for a in argv[1:] if a.partition("=")[0] not in verbatim]
    try:
        args = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ServeArgs), OmegaConf.from_dotlist(rest)))
    except OmegaConfBaseException as e:
        raise UserError(f"{e}\n{USAGE}") from None
    assert isinstance(args, ServeArgs)
    for key, value in verbatim.items():
        setattr(args, key, value)
    if args.speculative not in SPECULATIVE:
        raise UserError(f"speculative={args.speculative}: one of {', '.join(SPECULATIVE)}.")
    if args.max_queue < 0 or (args.max_tokens is not None and args.max_tokens < 1) or not 0 < args.port < 65536:
        raise UserError("need max_queue >= 0, max_tokens >= 1 and 0 < port < 65536.")
    return argv[0], args


def main(argv: list[str] | None = None) -> int:
    try:
        path, args = parse(sys.argv[1:] if argv is None else argv)
        console.set_verbose(args.verbose)
        app, described = _app(path, args)
    except REPORTED_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    print(described, flush=True)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("exporters.server").addHandler(handler)
    logging.getLogger("exporters.server").setLevel(logging.INFO)
    logging.getLogger("exporters.server").propagate = False  # uvicorn's root handler would print it again
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                access_log=args.verbose)
    return 0


def _app(path: str, args: ServeArgs):  # type: ignore[no-untyped-def]
    """The app over the loaded program, and the line that says what it serves."""
    from pathlib import Path

    from exporters.runtime.generator import Generator, resolve_program
    from exporters.server.app import Limits, create_app
    from exporters.server.engine import Engine, cache_reusable

    no_reuse = cache_reusable(resolve_program(path))
    with console.native_stderr_to(None):
        generator = Generator(path, args.tokenizer, every_adapter=True, load=False, keep_cache=no_reuse is None)
        generator.check_speculation(args.speculative)
        generator.load()
    engine = Engine(generator, args.max_queue, args.speculative)
    name = args.name or (Path(path).name if Path(path).is_dir() else generator.pte.stem)
    most = args.max_tokens or generator.max_context_len
    app = create_app(engine, Limits(most, args.max_request_bytes, args.api_key), name)
    models = ", ".join([name, *engine.models])
    reuse = "kept across turns" if no_reuse is None else f"not reused ({no_reuse})"
    logging.getLogger("uvicorn.error").setLevel(logging.INFO if args.verbose else logging.WARNING)
    return app, (f"serving {generator.pte} as {models} on http://{args.host}:{args.port}/v1 "
                 f"(loaded in {generator.load_seconds:.1f} s; cache {reuse}; "
                 f"{'API key required' if args.api_key else 'no API key'})")


if __name__ == "__main__":
    sys.exit(main())
