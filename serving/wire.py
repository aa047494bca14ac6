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
import logging

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    reason: str


class DecodeGuard(grpc.ServerInterceptor):
    """Answers undecodable requests INVALID_ARGUMENT instead of INTERNAL (see the module docstring)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
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

            def guarded_stream(request, context):
                _refuse_undecodable(request, context, method)
                yield from behaviour(request, context)

            return handler._replace(request_deserializer=guarded_decode, unary_stream=guarded_stream)
        behaviour = handler.unary_unary

        def guarded_unary(request, context):
            _refuse_undecodable(request, context, method)
            return behaviour(request, context)

        return handler._replace(request_deserializer=guarded_decode, unary_unary=guarded_unary)


def _refuse_undecodable(request, context: grpc.ServicerContext, method: str) -> None:
    if isinstance(request, Undecodable):
        log.warning("%s from %s: undecodable request (%s)", method, context.peer(), request.reason)
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request message does not decode ({request.reason}): string fields must be valid "
            "UTF-8 and the bytes a serialized request of this method",
        )
