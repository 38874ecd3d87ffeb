"""A request message that does not parse is INVALID_ARGUMENT, not UNKNOWN.

gRPC runs a handler's request deserializer before the handler, and an exception there
(protobuf's DecodeError: corrupt wire format, or a string field that is not UTF-8)
ends the RPC with UNKNOWN and a message about Python internals. `DecodeRequests` serves
every unary-request RPC with the raw bytes instead and parses them inside the handler,
so a bad message gets INVALID_ARGUMENT naming the message type, before any work; a string that
is not UTF-8 is named by its field (`texts[1]: not valid UTF-8`), found by walking the wire format.

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
            field = bad_utf8_field(parse.__self__.DESCRIPTOR, raw) if hasattr(parse, "__self__") else None
            if field is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: not valid UTF-8 text")
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


_MAX_DEPTH = 32


def bad_utf8_field(descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
    """The path of the first string field of `data` (a `descriptor` message) that is not UTF-8,
    e.g. `chat.messages[2].content`; None if there is none or the bytes are not a message."""
    counts: dict[str, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated:
                    index = counts[name] = counts.get(name, -1) + 1
                    name = f"{name}[{index}]"
                if field.type == field.TYPE_STRING:
                    chunk.decode("utf-8")
                elif field.type == field.TYPE_MESSAGE and depth < _MAX_DEPTH:
                    found = bad_utf8_field(field.message_type, chunk, name + ".", depth + 1)
                    if found is not None:
                        return found
            else:
                return None
    except UnicodeDecodeError:
        return name
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
