"""`Hashed`: a static jit argument hashed once, equal to another wrapping an equal value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxlora.engine.static_arg import Hashed


class CountingKey:
    """A hashable value that counts its hashes (nnx's GraphDef rehashes its node list per call)."""

    def __init__(self, key: tuple) -> None:
        self.key, self.hashes = key, 0

    def __hash__(self) -> int:
        self.hashes += 1
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountingKey) and self.key == other.key


def test_jit_calls_do_not_rehash_the_value():
    value = CountingKey(("layers", 4))
    static = Hashed(value)
    f = jax.jit(lambda x, *, g: x * len(g.value.key), static_argnames="g")
    for _ in range(5):
        out = f(jnp.ones(3), g=static)
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert value.hashes == 1  # once, when wrapped
    bare = CountingKey(("layers", 4))
    g = jax.jit(lambda x, *, g: x * len(g.key), static_argnames="g")
    for _ in range(5):
        g(jnp.ones(3), g=bare)
    assert bare.hashes >= 5  # what the wrapper saves: a hash per call


def test_equality_follows_the_value():
    a, b, c = Hashed(("x", 1)), Hashed(("x", 1)), Hashed(("x", 2))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != ("x", 1)  # a wrapper never equals a bare value


def test_immutable_and_unwrap_names_a_bare_value():
    h = Hashed(("x", 1))
    with pytest.raises(AttributeError, match="immutable"):
        h.value = ("y", 2)
    assert Hashed.unwrap(h, "step") == ("x", 1)
    with pytest.raises(TypeError, match="step: graphdef must be a Hashed"):
        Hashed.unwrap(("x", 1), "step")
