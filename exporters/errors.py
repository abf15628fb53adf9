"""User-fixable errors: the CLI prints their message (what was wrong, what is allowed, the fix) without a traceback."""

import signal
from typing import Iterable

from models.errors import ModelError


class UserError(Exception):
    """Bad input from the user: config, paths, or a combination that cannot work."""


class ValidationFailed(Exception):
    """The exported program ran but does not match the eager model within tolerance."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a stage: which stage it stopped and by which signal (the pipeline raises it in place
    of the bare KeyboardInterrupt). ``kept``: the program, when the stage came after finalize put it in place."""

    def __init__(self, stage: str, signum: signal.Signals = signal.SIGINT, kept: str | None = None) -> None:
        super().__init__(stage)
        self.stage, self.signum, self.kept = stage, signum, kept

    @property
    def signal_name(self) -> str:
        return self.signum.name

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process the signal stopped: 128 + its number."""
        return 128 + self.signum.value

    def describe(self) -> str:
        stopped = f"interrupted ({self.signal_name}) during the {self.stage} stage."
        if self.kept:
            return (f"{stopped} The program was already written and validated ({self.kept}, with its manifest); "
                    f"only the {self.stage} stage's result is missing from the manifest.")
        return (f"{stopped} Nothing was written: no program, data or temporary file is left, and a finished earlier "
                "export in this folder is as it was.")


#: Exceptions the CLI reports as a one-paragraph message and a non-zero exit code.
REPORTED_ERRORS = (UserError, ModelError, ValidationFailed)


def listed(values: Iterable[object]) -> str:
    """Config values as a message lists them: ``none, 8da4w, 8da8w``."""
    return ", ".join("none" if v is None else str(v) for v in values)


def check_choice(key: str, value: object, allowed: Iterable[object], fix: str) -> None:
    """Refuse ``key=value`` unless ``value`` is one of ``allowed`` (a registry's names), listing them and the fix."""
    allowed = list(allowed)
    if value not in allowed:
        raise UserError(f"{key}={value!r} is not known. Allowed: {listed(allowed)}. {fix}")
