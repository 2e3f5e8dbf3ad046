"""A Program as bytes and back: `dumps(program)` and `loads(data)`.

What `shard` uses it for: ranks of one launch that trace the same step share one trace (fxshard/share.py).
The bytes hold the graph node by node (op, name, target, arguments, meta), the root module's constants,
and the Program's typed records. Three kinds of object in a graph do not pickle as they are, and go as
descriptions:

- aten and custom ops (`torch.ops.ns.name.overload`) go by their qualified name;
- fake tensors (every node's meta["val"]) go as (shape, stride, offset, dtype, device, requires_grad)
  and come back as fake tensors of one new FakeTensorMode, the one the loaded program's passes then use;
- nodes inside arguments and meta go by name.

Invariant: `loads(dumps(p))` has the same nodes in the same order, with the same names, targets,
arguments and meta (fake values of the same metadata), the same constants and the same signature, so
every pass maps it to the program it maps `p` to (tests/test_share.py checks the passes' results
and the runtime's). What does not survive: aliasing between fake values (a view's value is a fresh
tensor of the view's metadata; no pass reads it), and meta that does not pickle (a key that holds a
process-local object): `dumps` raises for it rather than dropping it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import pickle

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .graph import Graph, attribute, fake_tensor, lazy_module
from .program import Program

_FORMAT = 1
_MAGIC = b"fxshard-program"
_loading_mode: contextvars.ContextVar[FakeTensorMode] = contextvars.ContextVar("fxshard_loading_mode")


class _NodeRef:
    """A node named inside another node's arguments or meta."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _NodeRef, (self.name,)


def _op(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _packet(namespace: str, name: str):
    return getattr(getattr(torch.ops, namespace), name)


def _fake(shape, stride, offset, dtype, device, requires_grad):
    value = fake_tensor(_loading_mode.get(), shape, stride, dtype, device, offset)
    if requires_grad:
        value.requires_grad_(True)
    return value


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            namespace, name = obj._schema.name.split("::")
            return _op, (namespace, name, obj._overloadname or "default")
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _packet, (namespace, name)
        if isinstance(obj, FakeTensor):
            return _fake, (tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype, obj.device,
                           obj.requires_grad)
        if isinstance(obj, fx.Node):
            return _NodeRef, (obj.name,)
        return NotImplemented


def _header() -> bytes:
    return _MAGIC + f" {_FORMAT} torch {torch.__version__}\n".encode()


def dumps(program: Program) -> bytes:
    """The program as bytes (`loads` reads them back)."""
    graph_module = program.graph_module
    nodes = [(node.op, node.name, node.target, node.args, node.kwargs, node.meta) for node in program.graph.nodes]
    constants = {node.target: attribute(graph_module, node.target) for node in program.graph.nodes
                 if node.op == "get_attr"}
    fields = {field.name: getattr(program, field.name) for field in dataclasses.fields(program)
              if field.name != "graph_module"}  # the typed records: every field but the graph
    buffer = io.BytesIO()
    buffer.write(_header())
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((nodes, constants, fields))
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise TypeError(f"program {program.name!r} does not serialize: {error}") from error
    return buffer.getvalue()


def loads(data: bytes, fake_mode: FakeTensorMode | None = None) -> Program:
    """The Program `dumps` wrote; its fake values belong to `fake_mode` (a new one if None)."""
    header = _header()
    if not data.startswith(header):  # objects pickled by another torch may not unpickle as the same ops
        first = data[:data.find(b"\n", len(_MAGIC) + 1) + 1]
        raise ValueError(f"bytes that begin {first!r} are not a program written by this fxshard and torch "
                         f"({header!r})")
    fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=False)
    token = _loading_mode.set(fake_mode)
    try:
        nodes, constants, fields = pickle.Unpickler(io.BytesIO(data[len(header):])).load()
    finally:
        _loading_mode.reset(token)
    graph, by_name = Graph(), {}

    def resolve(value):
        return by_name[value.name] if isinstance(value, _NodeRef) else value

    for op, name, target, args, kwargs, _ in nodes:
        node = graph.create_node(op, target, _map(args, resolve), _map(kwargs, resolve), name=name)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        by_name[name] = node
    for (*_, node_meta), node in zip(nodes, graph.nodes):  # meta may name a later node
        node.meta = _map(node_meta, resolve)
    root = torch.nn.Module()
    for target, value in constants.items():
        _set_attribute(root, target, value)
    return Program(lazy_module(root, graph), **fields)


def _map(value, fn):
    """`value` with fn applied to every _NodeRef in it (tuples, lists, dicts, slices)."""
    if isinstance(value, _NodeRef):
        return fn(value)
    if isinstance(value, tuple):
        mapped = tuple(_map(v, fn) for v in value)
        return type(value)(*mapped) if hasattr(value, "_fields") else mapped
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, dict):
        mapped = {k: _map(v, fn) for k, v in value.items()}
        return mapped if type(value) is dict else type(value)(mapped)
    if isinstance(value, slice):
        return slice(_map(value.start, fn), _map(value.stop, fn), _map(value.step, fn))
    return value


def _set_attribute(root: torch.nn.Module, target: str, value) -> None:
    *path, last = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(last, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(last, value)
    else:
        setattr(module, last, value)
