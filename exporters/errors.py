"""User-fixable errors: the CLI prints their message (what was wrong, what is allowed, the fix) without a traceback."""

from typing import Iterable

from models.errors import ModelError


class UserError(Exception):
    """Bad input from the user: config, paths, or a combination that cannot work."""


class ValidationFailed(Exception):
    """The exported program ran but does not match the eager model within tolerance."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a stage: which stage it stopped (the pipeline raises it in place of the bare KeyboardInterrupt)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage

    def describe(self) -> str:
        return (f"interrupted during the {self.stage} stage. No program was written (a provisional file is removed, "
                "a finished earlier export in this folder is left as it was).")


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
