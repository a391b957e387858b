"""Typed errors raised by the runtime. Each names the problem; none leaves engine state changed."""


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


class ModelLoadError(RuntimeErrorBase):
    """A model file or folder is missing, unreadable, truncated or of an unsupported kind."""
