"""Hostile input for any gRPC service: hypothesis strategies for any protobuf message, built by
walking its descriptor (the third-party protobuf strategies break on protobuf 7), and calls
that send raw bytes to any method, whatever its streaming shape."""

import math

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
# Extremes, and the values a real request would carry, so that some examples get past validation.
FLOATS = (0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-45, 3.4e38, -3.4e38, math.nan, math.inf, -math.inf)
TEXTS = ("", "hi", "user", "assistant", "system", "Hello, world", "\x00", "é" * 3)
SMALL_INTS = (0, 1, 2, 3, 5, 8)


def _integers(lo: int, hi: int):
    return st.one_of(st.sampled_from([v for v in SMALL_INTS if lo <= v <= hi] + [lo, hi]), st.integers(lo, hi))


def _scalar(field: F, depth: int, max_depth: int):
    t = field.type
    if t in INT_RANGES:
        return _integers(*INT_RANGES[t])
    if t == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from(FLOATS), st.floats(width=32))
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(FLOATS), st.floats())
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.sampled_from(TEXTS), st.text(max_size=16))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == F.TYPE_ENUM:  # open enums: numbers outside the declared values parse too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _integers(-(2**31), 2**31 - 1))
    return messages(field.message_type, depth + 1, max_depth)


def _field(field: F, depth: int, max_depth: int):
    """One field's value: a dict for a map, a list for a repeated field, else a scalar or message."""
    if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key, depth, max_depth), _scalar(value, depth, max_depth), max_size=3)
    if field.is_repeated:
        return st.lists(_scalar(field, depth, max_depth), max_size=3)
    return _scalar(field, depth, max_depth)


def messages(descriptor, depth: int = 0, max_depth: int = 3):
    """Messages of `descriptor`'s type with each field unset or set to a random value."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth >= max_depth:
        return st.just(cls())
    fields = {f.name: st.none() | _field(f, depth, max_depth) for f in descriptor.fields}
    return st.fixed_dictionaries(fields).map(lambda values: _build(cls, values))


def one_field_changed(base, max_depth: int = 3):
    """`base` with one field, at any depth, set to a random value: the rest stays valid, so the
    value meets the code past validation too."""
    paths = _field_paths(base.DESCRIPTOR, (), max_depth)
    return st.sampled_from(paths).flatmap(
        lambda p: _field(p[-1], len(p), max_depth + 1).map(lambda value: _changed(base, p, value)))


def _field_paths(descriptor, prefix: tuple, max_depth: int) -> list[tuple]:
    paths = []
    for f in descriptor.fields:
        paths.append((*prefix, f))
        nested = f.type == F.TYPE_MESSAGE and not f.is_repeated
        if nested and len(prefix) + 1 < max_depth:
            paths += _field_paths(f.message_type, (*prefix, f), max_depth)
    return paths


def _changed(base, path: tuple, value):
    m = type(base)()
    m.CopyFrom(base)
    parent = m
    for f in path[:-1]:
        parent = getattr(parent, f.name)
    parent.ClearField(path[-1].name)
    _set(parent, {path[-1].name: value})
    return m


def _build(cls, values: dict):
    return _set(cls(), values)


def _set(m, values: dict):
    for name, value in values.items():
        if value is None:
            continue
        field = getattr(m, name)
        if isinstance(value, dict):
            for k, v in value.items():
                if hasattr(v, "DESCRIPTOR"):
                    field[k].CopyFrom(v)
                else:
                    field[k] = v
        elif isinstance(value, list):
            field.extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            field.CopyFrom(value)
        else:
            setattr(m, name, value)
    return m


# -- raw calls --------------------------------------------------------------------------------


def methods(*services) -> list:
    """Every method of the given service descriptors."""
    return [m for s in services for m in s.methods]


def path(method) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def call_raw(channel: grpc.Channel, method, payloads: list[bytes], timeout: float = 10,
             responses: int = 2) -> tuple[grpc.StatusCode, str]:
    """Sends `payloads` as the request bytes of `method` (one for a unary request); reads up to
    `responses` responses of a stream, then cancels it. Returns (status, details); CANCELLED
    when the client cut a stream short."""
    shape = (method.client_streaming, method.server_streaming)
    factory = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
               (True, False): channel.stream_unary, (True, True): channel.stream_stream}[shape]
    call = factory(path(method), request_serializer=None, response_deserializer=None)
    request = iter(payloads) if method.client_streaming else payloads[0]
    try:
        if not method.server_streaming:
            call(request, timeout=timeout)
            return grpc.StatusCode.OK, ""
        stream = call(request, timeout=timeout)
        for i, _ in enumerate(stream):
            if i + 1 >= responses:
                stream.cancel()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
