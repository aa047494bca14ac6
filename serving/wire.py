"""Requests that do not decode are the caller's mistake: INVALID_ARGUMENT, one log line, no traceback.

gRPC Python decodes a request before its handler runs. When the decoder raises, gRPC logs
"Exception deserializing request!" with a traceback and answers INTERNAL, which the status table
keeps for bugs. Invalid UTF-8 in a string field (a lone surrogate can only arrive as such) and
corrupt protobuf bytes both end there. `DecodeGuard` wraps the decoder of every unary-request
method: a message that does not parse becomes an `Undecodable`, which the wrapped handler answers
with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    reason: str


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers undecodable requests INVALID_ARGUMENT instead of INTERNAL (see the module docstring).
    Guards the async handlers of a `grpc.aio` server (async generators and coroutines); a sync
    handler keeps its decoder, as its context's abort does not await."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        decode = handler.request_deserializer

        def guarded_decode(data: bytes):
            try:
                return decode(data)
            except DecodeError as e:
                return Undecodable(str(e) or type(e).__name__)

        if handler.response_streaming:
            behaviour = handler.unary_stream
            if inspect.isasyncgenfunction(behaviour):

                async def guarded_stream(request, context):
                    await _refuse_undecodable(request, context, method)
                    async for response in behaviour(request, context):
                        yield response

            elif inspect.iscoroutinefunction(behaviour):  # writes with context.write (health's Watch)

                async def guarded_stream(request, context):
                    await _refuse_undecodable(request, context, method)
                    return await behaviour(request, context)

            else:
                return handler
            return handler._replace(request_deserializer=guarded_decode, unary_stream=guarded_stream)
        behaviour = handler.unary_unary
        if not inspect.iscoroutinefunction(behaviour):
            return handler

        async def guarded_unary(request, context):
            await _refuse_undecodable(request, context, method)
            return await behaviour(request, context)

        return handler._replace(request_deserializer=guarded_decode, unary_unary=guarded_unary)


async def _refuse_undecodable(request, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(request, Undecodable):
        log.warning("%s from %s: undecodable request (%s)", method, context.peer(), request.reason)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request message does not decode ({request.reason}): string fields must be valid "
            "UTF-8 and the bytes a serialized request of this method",
        )
