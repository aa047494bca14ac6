"""A small Python client for `jaxlora serve`.

    with InferenceClient("127.0.0.1:50051") as client:
        for chunk in client.stream("Write a haiku", adapter="poet", max_tokens=32):
            print(chunk.text, end="", flush=True)
        print(client.generate("2+2=", adapter="math").text)

Errors arrive as `grpc.RpcError` with the server's status code (`e.code()`) and reason (`e.details()`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.gen import inference_pb2 as pb
from serving.gen import inference_pb2_grpc as pb_grpc

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole streamed answer, accumulated."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[pb.TokenLogprob, ...] = ()  # one per token, when the call set logprobs


class InferenceClient:
    """One channel to one server. Thread-safe: streams may run concurrently from several threads.

    Args:
      target: "host:port".
      api_key: sent as `authorization: Bearer <key>` on every call (the admin key for Load/Unload).
      timeout: default deadline of each call in seconds (None: no deadline).
      max_message_bytes: largest message accepted from the server.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        max_message_bytes: int = 4 * 2**20,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the channel connects; raises grpc.FutureTimeoutError after `timeout` s."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # Generation.
    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        adapter: str = "",
        request_id: str = "",
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        timeout: float | None = None,
        **extra: float | int | bool | None,
    ) -> grpc.Call:
        """Starts a Generate call; iterate the result for GenerateResponse chunks, `.cancel()` to stop.

        Give `prompt` (raw text) or `messages` ([{"role", "content"}], rendered with the chat template).
        Unset sampling fields take the server defaults. `extra`: the other optional GenerateRequest
        fields (min_p, min_tokens, ignore_eos, repetition_penalty, presence_penalty,
        frequency_penalty, logprobs); a name the message lacks raises ValueError.
        """
        sampling = {
            k: v
            for k, v in dict(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **extra
            ).items()
            if v is not None
        }
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt=prompt or "",
            adapter=adapter or "",
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            **sampling,
        )
        return self._stub.Generate(request, timeout=self._timeout(timeout), metadata=self._metadata)

    def generate(self, prompt: str | None = None, **kw) -> Completion:
        """Runs a Generate call to the end (same arguments as `stream`)."""
        text, ids, logprobs, last = [], [], [], None
        for chunk in self.stream(prompt, **kw):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            last = chunk
        return Completion(
            request_id=last.request_id,
            text="".join(text),
            token_ids=tuple(ids),
            finish_reason=_FINISH_NAMES.get(last.finish_reason, "unspecified"),
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            logprobs=tuple(logprobs),
        )

    # Adapters and server.
    def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> pb.AdapterInfo:
        return self._stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, path=str(path)), timeout=self._timeout(timeout), metadata=self._metadata
        )

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        self._stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name=name), timeout=self._timeout(timeout), metadata=self._metadata
        )

    def list_adapters(self, *, timeout: float | None = None) -> list[pb.AdapterInfo]:
        return list(
            self._stub.ListAdapters(
                pb.ListAdaptersRequest(), timeout=self._timeout(timeout), metadata=self._metadata
            ).adapters
        )

    def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return self._stub.GetServerInfo(
            pb.GetServerInfoRequest(), timeout=self._timeout(timeout), metadata=self._metadata
        )

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """ "SERVING", "NOT_SERVING", ... for `service` ("" = the whole server)."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout
