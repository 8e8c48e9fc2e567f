"""What the ranks of a group send each other, as bytes, read back safely.

The ranks run one code base, and pickle carries the dataclasses of a tick or a
budget as they are. But the ring is unauthenticated: unpickled as is, bytes any
host could send to a rank's port ran code there. Reading them back builds only
this project's dataclasses and enums and plain values; anything else (a function
to call, a module's attribute) is refused before it is looked up.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

# the packages whose dataclasses and enums cross the ring
OWN_PACKAGES = ("scheduler.", "kvcache.", "engine.")
PLAIN_BUILTINS = frozenset(
    {
        "bool",
        "bytes",
        "complex",
        "dict",
        "float",
        "frozenset",
        "int",
        "list",
        "set",
        "slice",
        "str",
        "tuple",
    }
)


class UnsafeBytes(pickle.UnpicklingError):
    """Bytes naming something a rank never sends."""


class _GroupUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's own unpickler (the C one's opcodes cannot be checked one by one):
    a class it hands out is only ever instantiated, and only objects it made get a
    state (BUILD on a class or an enum member changed it process-wide:
    ``SamplingParams.temperature = ...``, ``FinishReason.STOP.value = ...``)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: io.BytesIO):
        super().__init__(file)
        self._made: set[int] = set()  # ids of the objects this load created

    def _newobj(self) -> None:
        self._not_an_enum(self.stack[-2])  # NEWOBJ: cls, args
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]
        self._made.add(id(self.stack[-1]))

    def _newobj_ex(self) -> None:
        self._not_an_enum(self.stack[-3])  # NEWOBJ_EX: cls, args, kwargs
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]
        self._made.add(id(self.stack[-1]))

    @staticmethod
    def _not_an_enum(cls: Any) -> None:
        # Enum.__new__ returns the existing member: "made", it would take a state
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            raise UnsafeBytes("an enum member is looked up, never made")

    def _build(self) -> None:
        # only what this load made gets its state: a class, or an enum member (a
        # process-wide singleton), set by a stranger's bytes changed every rank's
        if id(self.stack[-2]) not in self._made:
            raise UnsafeBytes("bytes that change an existing object are nothing a rank sends")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.NEWOBJ[0]] = _newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _newobj_ex
    dispatch[pickle.BUILD[0]] = _build

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in PLAIN_BUILTINS:
            return super().find_class(module, name)
        if "." not in name and module.startswith(OWN_PACKAGES):
            found = super().find_class(module, name)
            if isinstance(found, type) and (
                dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
            ):
                return found
        raise UnsafeBytes(f"{module}.{name} is nothing a rank sends")


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return _GroupUnpickler(io.BytesIO(data)).load()
