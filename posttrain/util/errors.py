"""Errors that end a run with a one-line message (the command line prints it, no traceback)."""


class ConfigError(ValueError):
    """A config value is wrong; the message names the field, the value and what is accepted."""


class NonFiniteError(RuntimeError):
    """Several optimizer steps in a row had a non-finite loss or gradient: the run stops."""


class EngineError(RuntimeError):
    """The sampling engines cannot go on: every vLLM engine failed, one holds weights other than
    the trainer's after a push, or a server did not start."""


class FailingSourceError(RuntimeError):
    """A reward function, verifier, tool or environment failed on most of its calls for several
    steps in a row: the run stops with the first failure's traceback instead of learning nothing."""
