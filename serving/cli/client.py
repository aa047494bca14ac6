"""`jaxlora client --prompt TEXT [--adapter NAME]`: stream one reply from a running server.

`--prompt` is a user message, rendered with the model's chat template (as `jaxlora generate
--prompt`); `--raw` sends it as raw text to complete (the gRPC `prompt` field).
"""

from __future__ import annotations

import argparse
import os
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--api-key",
        default=os.environ.get("JAXLORA_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (default: $JAXLORA_API_KEY)",
    )
    p.add_argument("--adapter", default="", help="adapter name (default: the base model)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="a user message (chat template applied; --raw: text to complete as is)")
    what.add_argument("--list-adapters", action="store_true", help="list the server's adapters and exit")
    what.add_argument("--info", action="store_true", help="print the server's model and limits and exit")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the server's, 1)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def run(args: argparse.Namespace) -> int:
    import grpc

    from serving.client import InferenceClient

    with InferenceClient(f"{args.host}:{args.port}", api_key=args.api_key, timeout=args.timeout) as client:
        try:
            if args.list_adapters:
                adapters = client.list_adapters()
                if not adapters:
                    print("no adapters loaded (requests without an adapter use the base model)")
                for a in adapters:
                    where = f"slot {a.slot}" if a.resident else "host"
                    print(f"{a.name}\trank {a.rank}\t{','.join(a.target_modules)}\t{where}\t{a.in_flight} in flight")
                return 0
            if args.info:
                print(format_info(client.server_info()))
                return 0
            return _stream(client, args)
        except grpc.RpcError as e:
            print(f"\njaxlora client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def _stream(client, args: argparse.Namespace) -> int:
    chat = dict(prompt=args.prompt) if args.raw else dict(messages=[{"role": "user", "content": args.prompt}])
    last = None
    for chunk in client.stream(
        adapter=args.adapter,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        **chat,
    ):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    if last is not None:
        from serving.gen import inference_pb2 as pb

        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"[{reason}; {last.prompt_tokens} prompt + {last.completion_tokens} completion tokens]", file=sys.stderr)
    return 0


def format_info(info) -> str:
    """GetServerInfo's answer as aligned `name: value` lines, in the message's field order."""
    rows = []
    for field in info.DESCRIPTOR.fields:
        value = getattr(info, field.name)
        if not isinstance(value, (str, int, float)):  # a repeated field
            value = ", ".join(map(str, value)) or "-"
        rows.append((field.name.replace("_", " "), str(value)))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name + ':':<{width + 1}} {value}" for name, value in rows)
