"""A flood of maximal prompts cannot stall admission: another stream's time to first token stays
within 2x of its time on an idle server.

Four client processes each send a prompt just under the 4 MiB message cap, wait for the answer,
pause PAUSE seconds and send again (16 prompts of 3.9 MB a second in all); meanwhile a probe stream
measures its TTFT. Tokenizing one such prompt held the GIL for seconds, so every stream stalled
behind the flood; now the engine refuses it by its length before tokenizing. (Unpaced, four local
clients of any kind, even small valid requests, take enough of a 2-core machine to triple a tiny
model's TTFT: the pause keeps the test about stalls, not about sharing two cores.)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.serving.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
NUM_PROBES = 7
HUGE = 3_900_000  # characters; under the 4 MiB request cap
PAUSE = 0.25  # seconds a flooding client waits between prompts

# One flooding client: sends a prompt of SIZE characters every PAUSE seconds until killed, prints
# the outcome of each.
_FLOODER = """import sys, time, grpc
from serving.gen import inference_pb2 as pb
target, size, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
payload = pb.GenerateRequest(prompt="x" * size, max_tokens=1).SerializeToString()
channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 8 << 20)])
generate = channel.unary_stream("/jaxlora.v1.Inference/Generate")
while True:
    try:
        list(generate(payload, timeout=60))
        print("answered", flush=True)
    except grpc.RpcError as e:
        print(e.code().name, flush=True)
    time.sleep(pause)
"""


def _ttft(client) -> float:
    start = time.perf_counter()
    call = client.stream(messages=[{"role": "user", "content": "probe"}], max_tokens=4)
    first = next(iter(call))
    seconds = time.perf_counter() - start
    assert first.token_ids
    for _ in call:
        pass
    return seconds


def _ttfts(client) -> list[float]:
    return [_ttft(client) for _ in range(NUM_PROBES)]


def test_a_flood_of_maximal_prompts_keeps_ttft_within_2x_of_idle(server, client, tmp_path):
    _ttft(client)  # the first stream of a server pays for lazy set-up
    idle = _ttfts(client)
    logs = [tmp_path / f"flooder-{i}.log" for i in range(4)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flooders = [
        subprocess.Popen(
            [sys.executable, "-c", _FLOODER, f"127.0.0.1:{server.port}", str(HUGE), str(PAUSE)],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )
        for log in logs
    ]
    try:
        wait_until(lambda: all(log.read_text() for log in logs), timeout=120)  # every flooder is refused
        flooded = statistics.median(_ttfts(client))
    finally:
        for p in flooders:
            p.kill()
            p.wait(30)
    idle = statistics.median(idle + _ttfts(client))  # before and after: the machine's load drifts
    outcomes = [log.read_text().split() for log in logs]
    print(
        f"\nTTFT median: idle {idle * 1e3:.1f} ms, flooded {flooded * 1e3:.1f} ms; "
        f"refusals per flooder: {[len(o) for o in outcomes]}"
    )
    assert {word for o in outcomes for word in o} == {"INVALID_ARGUMENT"}, outcomes
    assert flooded <= 2 * idle, (idle, flooded)
