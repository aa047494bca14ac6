"""Research scripts: kernel, paging, serving and end-to-end benchmarks (results/ holds their output).

Run them from the repository root as modules, e.g. `python -m benchmarks.kernels --help`; shared
helpers live in `benchmarks.common`. The end-to-end benchmark is also the `jaxlora bench` command
(`benchmarks.commands`). Importing this package imports nothing else: benchmarks/hf_peer.py runs
in the reference environment, without JAX.
"""
