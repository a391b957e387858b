"""Typed errors raised by the runtime, and the start error every process reports in one line.

Each runtime error names the problem; none leaves engine state changed. A `StartError` says why
a process cannot start as configured, in one line that names the setting to change: the gateway
prints it and exits 1 (the traceback only with --debug); a worker prints it after
START_ERROR_PREFIX on stderr and exits START_ERROR_EXIT, and the gateway, which forwards every
other stderr line, keeps that one and reports it instead of restarting a worker that will never
start.
"""

START_ERROR_EXIT = 3
START_ERROR_PREFIX = "StartError: "
# the log lines of the gateway and of its workers (whose stderr it forwards): one format
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class StartError(Exception):
    """A process cannot start as configured: a one-line reason naming what to change."""


class RuntimeErrorBase(Exception):
    """Base of every error the runtime raises on purpose."""


class InvalidRequestError(RuntimeErrorBase, ValueError):
    """A request (prompt, sampling parameters, ids) is malformed; nothing was admitted."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the requested output does not fit in the model's context."""


class DuplicateRequestError(InvalidRequestError):
    """A request with the same id is already in the engine."""


class ModelLoadError(RuntimeErrorBase, StartError):
    """A model file or folder is missing, unreadable, truncated or of an unsupported kind."""


def one_line(exc: BaseException) -> str:
    """An error's message on one line (its white space folded); its type when it has none."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
