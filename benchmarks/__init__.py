"""Research scripts, grouped by what they measure (results/ holds their output):

    kernels/   one op over several layers in one jitted call, against its bytes floor
    step/      the engine's jitted step alone, op by op, per kernel choice, tensor parallel
    engine/    the real Engine in-process: closed loop (`jaxlora bench`), host loop, paging
    serving/   an open-loop trace replayed against the engine: req/s at an SLO, TTFT, TPOT
    probes/    one-question probes that design decisions rest on

Run them from the repository root as modules, e.g. `python -m benchmarks.kernels.lora --help`; shared
helpers live in `benchmarks.common`. The end-to-end benchmark is also the `jaxlora bench` command
(`benchmarks.commands`). Importing this package or a group imports nothing else:
benchmarks/engine/hf_peer.py runs in the reference environment, without JAX.
"""
