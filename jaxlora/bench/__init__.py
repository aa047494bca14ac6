"""Benchmarks that ship with the package (`jaxlora bench`); research scripts live in benchmarks/."""
