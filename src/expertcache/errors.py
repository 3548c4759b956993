"""Errors that reach a user: each names the file, tensor or value at fault and what was expected."""


class ExpertCacheError(Exception):
    """A user-facing error. The CLI prints its message on one line and exits with code 2."""
