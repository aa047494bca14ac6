"""A static jit argument that is hashed once.

jit hashes every static argument on every call to find the compiled program. nnx's `GraphDef`
hashes its whole node list each time, a cost paid by every engine step on the host's critical path
(benchmarks/DECISIONS.md#static-arg-hash). `Hashed` keeps the hash it computed when it was made; two of them are
equal when their values are (the same object in the engine: one `Hashed` per runner).
"""

from __future__ import annotations


class Hashed[T]:
    """value: a hashable, immutable object (a `GraphDef`); read it back with `.value`. Immutable
    itself: the hash is the value's at construction."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: T) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "_hash", hash(value))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Hashed is immutable (its hash was taken when it was made); cannot set {name}")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Hashed):
            return NotImplemented
        return self.value is other.value or (self._hash == other._hash and self.value == other.value)

    def __repr__(self) -> str:
        return f"Hashed({type(self.value).__name__})"

    @staticmethod
    def unwrap(arg: object, where: str) -> object:
        """The value of a `Hashed` static argument; a clear error for a bare value (a caller that
        passed the model's GraphDef itself instead of `Runner.step_static`'s)."""
        if not isinstance(arg, Hashed):
            raise TypeError(f"{where}: graphdef must be a Hashed (Runner.step_static), got {type(arg).__name__}")
        return arg.value
