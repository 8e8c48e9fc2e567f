"""Errors about models that the CLI turns into clear messages (no mlx import)."""


class UnsupportedModelError(ValueError):
    """The path is not a model kvwarm can serve; the message says what was expected."""
