"""User-fixable errors: the CLI prints their message (what was wrong, what is allowed, the fix) without a traceback."""

from models.errors import ModelError


class UserError(Exception):
    """Bad input from the user: config, paths, or a combination that cannot work."""


class ValidationFailed(Exception):
    """The exported program ran but does not match the eager model within tolerance."""


#: Exceptions the CLI reports as a one-paragraph message and a non-zero exit code.
REPORTED_ERRORS = (UserError, ModelError, ValidationFailed)
