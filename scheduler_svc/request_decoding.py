"""A request message that does not parse is INVALID_ARGUMENT, not UNKNOWN.

gRPC runs a handler's request deserializer before the handler, and an exception there
(protobuf's DecodeError: corrupt wire format, or a string field that is not UTF-8)
ends the RPC with UNKNOWN and a message about Python internals. `DecodeRequests` serves
every unary-request RPC with the raw bytes instead and parses them inside the handler,
so a bad message gets INVALID_ARGUMENT naming the message type, before any work.

Placed after the API-key interceptor (`grpc.aio.server(interceptors=[keys, decoding])`),
an unauthenticated request is refused on its metadata and never parsed at all.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError


class DecodeRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _parsing_in_handler(handler)


def _parsing_in_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a pass-through deserializer: it parses the bytes itself, INVALID_ARGUMENT if they do not."""
    parse, serializer = handler.request_deserializer, handler.response_serializer

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return parse(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message: {exc}")

    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def stream(raw, context):
            responses = inner_stream(await parsed(raw, context), context)
            if hasattr(responses, "__aiter__"):
                async for response in responses:
                    yield response
            else:  # a plain generator handler
                for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=serializer)
    inner = handler.unary_unary

    async def unary(raw, context):
        response = inner(await parsed(raw, context), context)
        return await response if inspect.isawaitable(response) else response

    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=None, response_serializer=serializer)
