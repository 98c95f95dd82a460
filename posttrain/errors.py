"""Errors that end a run with a one-line message (the command line prints it, no traceback)."""


class NonFiniteError(RuntimeError):
    """Several optimizer steps in a row had a non-finite loss or gradient: the run stops."""
