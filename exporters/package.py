"""``python -m exporters.package <run folder> [out=<dir>]`` and ``python -m exporters.package --verify <bundle>``.

Makes a release bundle (folder + .tar.gz) from a validated export, or re-checks every file of one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from exporters.release.bundle import make_bundle, verify_bundle
from exporters.errors import UserError

USAGE = "usage: python -m exporters.package <run folder> [out=<dir>] | --verify <bundle folder or .tar.gz>"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 2 and args[0] == "--verify":
            problems = verify_bundle(Path(args[1]))
            for problem in problems:
                print(f"FAIL {problem}", file=sys.stderr)
            print(f"{args[1]}: " + ("every file matches its sha256" if not problems else f"{len(problems)} problem(s)"))
            return 1 if problems else 0
        if not args or args[0].startswith("-") or len(args) > 2 or (len(args) == 2 and not args[1].startswith("out=")):
            raise UserError(USAGE)
        out = Path(args[1].removeprefix("out=")) if len(args) == 2 else None
        folder, archive = make_bundle(Path(args[0]), out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"bundle: {folder}\narchive: {archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
