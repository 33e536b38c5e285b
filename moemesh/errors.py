"""The errors a user can cause. Each carries one line that names the problem; the CLI prints it
without a traceback and exits with code 2."""


class MoemeshError(Exception):
    """Base class of every error caused by user input (config, data, checkpoint)."""


class ConfigError(MoemeshError, ValueError):
    """An invalid or unknown configuration value."""


class CheckpointError(MoemeshError):
    """A checkpoint or pretrained directory that is missing, incomplete or does not fit the model."""


class DataError(MoemeshError):
    """A data or tokenizer file that is missing or unreadable."""


class RequestError(MoemeshError):
    """A generation request with an invalid field (`param` names it, as OpenAI's errors do)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class DivergedError(MoemeshError):
    """A run whose loss or gradient norm stayed non-finite for `train.max_bad_steps` steps in a row,
    or whose weights became non-finite (a learning rate too high for the model, most often)."""
