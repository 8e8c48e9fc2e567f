"""Errors about models that the CLI turns into clear messages (no mlx import)."""


class LastingLoadError(Exception):
    """A load failure the same start would meet again (the model, the settings):
    the CLI exits 2, which the service units leave down instead of retrying."""


class UnsupportedModelError(LastingLoadError, ValueError):
    """The path is not a model kvwarm can serve; the message says what was expected."""


class NoRoomForKV(LastingLoadError, MemoryError):
    """The memory budget leaves nothing for KV once the weights are in."""


class BudgetBeyondMachine(LastingLoadError, ValueError):
    """A --memory-budget larger than all the memory the machine has."""


class AdapterSettingError(LastingLoadError, RuntimeError):
    """An --adapter that cannot be mounted on this model."""


class NotAModel(ValueError):
    """The path holds no model kvwarm can read (a file's header says so)."""
