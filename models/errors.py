"""Errors a user can fix (wrong path, unsupported architecture, damaged file): shown without a traceback."""


class ModelError(Exception):
    """A problem with the model or checkpoint the user asked for, with the fix in its message."""
