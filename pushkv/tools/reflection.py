"""A small grpcurl: list, describe and call gRPC services using only server reflection.

Nothing here imports the generated pushkv modules: every descriptor and message
class comes from the server's reflection service, so these helpers work
against any gRPC server that enables reflection (the coordinator does).

    list_services("127.0.0.1:50151")
    describe("127.0.0.1:50151", "pushkv.v1.StatusService")
    call_json("127.0.0.1:50151", "pushkv.v1.StatusService/ListTransfers", '{"limit": 5}')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import (
    Descriptor,
    EnumDescriptor,
    FieldDescriptor,
    MethodDescriptor,
    ServiceDescriptor,
)
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

ChannelOrAddress = grpc.Channel | str
Metadata = tuple[tuple[str, str | bytes], ...]

_SCALARS: dict[int, str] = {
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_FIXED64: "fixed64",
    FieldDescriptor.TYPE_FIXED32: "fixed32",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_SFIXED32: "sfixed32",
    FieldDescriptor.TYPE_SFIXED64: "sfixed64",
    FieldDescriptor.TYPE_SINT32: "sint32",
    FieldDescriptor.TYPE_SINT64: "sint64",
}


@contextlib.contextmanager
def _channel(target: ChannelOrAddress) -> Iterator[grpc.Channel]:
    if isinstance(target, str):
        ch = grpc.insecure_channel(target)
        try:
            yield ch
        finally:
            ch.close()
    else:
        yield target


class Reflector:
    """Descriptors fetched lazily from one server's reflection service."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self._db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self._db)

    def services(self) -> list[str]:
        return sorted(str(s) for s in self._db.get_services())

    def service(self, name: str) -> ServiceDescriptor:
        return self.pool.FindServiceByName(name)

    def method(self, name: str) -> MethodDescriptor:
        """`pkg.Service/Method` (as grpcurl spells it) or `pkg.Service.Method`."""
        service, sep, method = name.lstrip("/").rpartition("/")
        if not sep:
            service, sep, method = name.rpartition(".")
        if not sep or not service or not method:
            raise ValueError(f"not a method name: {name!r} (want pkg.Service/Method)")
        svc = self.service(service)
        try:
            return svc.methods_by_name[method]
        except KeyError:
            raise KeyError(f"service {service} has no method {method}") from None

    def message_class(self, desc: Descriptor) -> type[Message]:
        return message_factory.GetMessageClass(desc)

    def describe(self, symbol: str) -> str:
        """What `grpcurl describe SYMBOL` prints: a service, method, message or enum."""
        symbol = symbol.lstrip(".")
        with contextlib.suppress(KeyError):
            svc = self.service(symbol)
            return f"{svc.full_name} is a service:\n{_render_service(svc)}"
        with contextlib.suppress(KeyError, ValueError):
            m = self.method(symbol)
            return f"{m.full_name} is a method:\n{_render_method(m)}"
        with contextlib.suppress(KeyError):
            msg = self.pool.FindMessageTypeByName(symbol)
            return f"{msg.full_name} is a message:\n{_render_message(msg)}"
        with contextlib.suppress(KeyError):
            enum = self.pool.FindEnumTypeByName(symbol)
            return f"{enum.full_name} is an enum:\n{_render_enum(enum)}"
        raise KeyError(f"symbol not found: {symbol}")

    def call_json(
        self,
        method: str,
        request_json: str = "{}",
        *,
        timeout: float | None = 10.0,
        max_messages: int | None = None,
        metadata: Metadata | None = None,
        proto_names: bool = False,
    ) -> str:
        """Call a unary or server-streaming method; one JSON document per response.

        A server stream is read until it ends or `max_messages` arrived (then
        it is cancelled). gRPC errors propagate as grpc.RpcError.
        """
        m = self.method(method)
        if m.client_streaming:
            raise ValueError(f"{m.full_name} is client-streaming; not supported")
        req_cls = self.message_class(m.input_type)
        resp_cls = self.message_class(m.output_type)
        request = json_format.Parse(request_json or "{}", req_cls())
        path = f"/{m.containing_service.full_name}/{m.name}"

        def to_json(msg: Message) -> str:
            return json_format.MessageToJson(msg, preserving_proto_field_name=proto_names)

        if not m.server_streaming:
            unary = self.channel.unary_unary(
                path,
                request_serializer=req_cls.SerializeToString,
                response_deserializer=resp_cls.FromString,
            )
            return to_json(unary(request, timeout=timeout, metadata=metadata))
        stream = self.channel.unary_stream(
            path,
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString,
        )
        call = stream(request, timeout=timeout, metadata=metadata)
        out: list[str] = []
        try:
            for msg in call:
                out.append(to_json(msg))
                if max_messages is not None and len(out) >= max_messages:
                    break
        finally:
            call.cancel()  # type: ignore[no-untyped-call]
        return "\n".join(out)


# ------------------------------------------------------------------ module API


def list_services(target: ChannelOrAddress) -> list[str]:
    """Full names of every service the server exposes (sorted)."""
    with _channel(target) as ch:
        return Reflector(ch).services()


def describe(target: ChannelOrAddress, symbol: str) -> str:
    """A service, method, message or enum, rendered in .proto syntax."""
    with _channel(target) as ch:
        return Reflector(ch).describe(symbol)


def call_json(
    target: ChannelOrAddress,
    method: str,
    request_json: str = "{}",
    *,
    timeout: float | None = 10.0,
    max_messages: int | None = None,
    metadata: Metadata | None = None,
    proto_names: bool = False,
) -> str:
    """Call `pkg.Service/Method` with a JSON request; return the JSON response(s)."""
    with _channel(target) as ch:
        return Reflector(ch).call_json(
            method,
            request_json,
            timeout=timeout,
            max_messages=max_messages,
            metadata=metadata,
            proto_names=proto_names,
        )


# ------------------------------------------------------------------ rendering


def _type_name(f: FieldDescriptor) -> str:
    if f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type is not None:
        return "." + f.message_type.full_name
    if f.type == FieldDescriptor.TYPE_ENUM and f.enum_type is not None:
        return "." + f.enum_type.full_name
    return _SCALARS.get(f.type, "?")


def _render_field(f: FieldDescriptor) -> str:
    mt = f.message_type
    if mt is not None and mt.GetOptions().map_entry:
        k, v = mt.fields_by_name["key"], mt.fields_by_name["value"]
        return f"map<{_type_name(k)}, {_type_name(v)}> {f.name} = {f.number};"
    label = "repeated " if f.is_repeated else ""
    return f"{label}{_type_name(f)} {f.name} = {f.number};"


def _render_method(m: MethodDescriptor) -> str:
    cs = "stream " if m.client_streaming else ""
    ss = "stream " if m.server_streaming else ""
    return (
        f"rpc {m.name} ( {cs}.{m.input_type.full_name} ) "
        f"returns ( {ss}.{m.output_type.full_name} );"
    )


def _render_service(svc: ServiceDescriptor) -> str:
    lines = [f"service {svc.name} {{"]
    lines += [f"  {_render_method(m)}" for m in svc.methods]
    lines.append("}")
    return "\n".join(lines)


def _render_enum(enum: EnumDescriptor, indent: str = "") -> str:
    lines = [f"{indent}enum {enum.name} {{"]
    lines += [f"{indent}  {v.name} = {v.number};" for v in enum.values]
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def _render_message(msg: Descriptor, indent: str = "") -> str:
    lines = [f"{indent}message {msg.name} {{"]
    inner = indent + "  "
    real_oneofs = [o for o in msg.oneofs if not (len(o.fields) == 1 and o.name.startswith("_"))]
    in_oneof = {f.name for o in real_oneofs for f in o.fields}
    for f in msg.fields:
        if f.name not in in_oneof:
            lines.append(f"{inner}{_render_field(f)}")
    for o in real_oneofs:
        lines.append(f"{inner}oneof {o.name} {{")
        lines += [f"{inner}  {_render_field(f)}" for f in o.fields]
        lines.append(f"{inner}}}")
    for nested in msg.nested_types:
        if not nested.GetOptions().map_entry:
            lines.append(_render_message(nested, inner))
    lines += [_render_enum(e, inner) for e in msg.enum_types]
    lines.append(f"{indent}}}")
    return "\n".join(lines)
