"""What crosses a process boundary on the hot paths, in one form: a dataclass as the tuple of its
fields' values, each field that holds a dataclass (or a list of them, or None) likewise, and
rebuilt from it on the other side.

Two flows use it: a step's outputs from the engine process to its replica (`engine/outputs.py`,
`RequestOutput`) and a step's chunks from a replica to an ingress's token socket
(`token_socket/frame.py`, `ReplicaChunk`). Pickling a dataclass object calls back into Python
for each object (its `__reduce__`), on the sender's hot loop, for every stream every step; a
tuple of plain values pickle writes by itself. The pack and unpack functions are generated from
the dataclass's own fields and type hints, so a field added to the dataclass crosses with no
other change. Fields typed otherwise (`Any`, a dict, an exception) cross as they are.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

# A flat form: (pack, unpack) of one dataclass.
Flat = tuple[Callable[[Any], tuple], Callable[[tuple], Any]]
_forms: dict[type, Flat] = {}


def flat(cls: type) -> Flat:
    """The generated (pack, unpack) pair of a dataclass whose fields are all init arguments:
    pack(obj) is a tuple in field order, unpack(tuple) the equal object."""
    if cls not in _forms:
        _forms[cls] = _generate(cls)
    return _forms[cls]


def _nested(hint: Any) -> tuple[str, type] | None:
    """('one' | 'list', dataclass) when a field holds a dataclass or a list of them (either
    possibly None), else None: crossed as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]  # X | None
    if dataclasses.is_dataclass(hint):
        return "one", hint
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (Any,)
        if dataclasses.is_dataclass(item):
            return "list", item
    return None


def _generate(cls: type) -> Flat:
    scope: dict[str, Any] = {}
    pack, unpack = _expressions(cls, "o", "t", scope)
    source = f"def pack(o):\n    return {pack}\ndef unpack(t):\n    return {unpack}\n"
    exec(compile(source, f"<flat form of {cls.__qualname__}>", "exec"), scope)  # noqa: S102
    return scope["pack"], scope["unpack"]


def _expressions(cls: type, obj: str, packed: str, scope: dict[str, Any]) -> tuple[str, str]:
    """The expressions that pack the object named obj and unpack the tuple named packed. Nested
    dataclasses are written inline (a function call per nested object cost more than the
    packing), each level with variables of its own."""
    fields = dataclasses.fields(cls)
    if not all(f.init for f in fields):
        raise TypeError(f"{cls.__name__}: every field must be an __init__ argument")
    hints = typing.get_type_hints(cls)
    name = f"c{len(scope)}"
    scope[name] = cls
    level = len(scope)
    packs, unpacks = [], []
    for i, f in enumerate(fields):
        value, item = f"{obj}.{f.name}", f"{packed}[{i}]"
        nested = _nested(hints[f.name])
        if nested is None:
            packs.append(value)
            unpacks.append(item)
            continue
        kind, inner = nested
        o, t = f"o{level}_{i}", f"t{level}_{i}"
        pack, unpack = _expressions(inner, o, t, scope)
        if kind == "one":
            packs.append(f"(None if ({o} := {value}) is None else {pack})")
            unpacks.append(f"(None if ({t} := {item}) is None else {unpack})")
        else:
            packs.append(f"(None if {value} is None else [{pack} for {o} in {value}])")
            unpacks.append(f"(None if {item} is None else [{unpack} for {t} in {item}])")
    return f"({', '.join(packs)},)", f"{name}({', '.join(unpacks)})"
