"""Exceptions with messages that name the file, key, shape or value at fault."""


class GPT2JaxError(ValueError):
    """Base class of every error gpt2_jax raises for bad input."""


class ConfigError(GPT2JaxError):
    """A config value is invalid or unsupported."""


class CheckpointError(GPT2JaxError):
    """A checkpoint file is missing, truncated, of an unknown format, or holds the wrong tensors."""


class InputError(GPT2JaxError):
    """Token ids or sequence lengths that the model cannot take."""
