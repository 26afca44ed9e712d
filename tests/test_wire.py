"""serve_app.wire: a dataclass crosses a process boundary as the tuple of its fields' values,
nested dataclasses likewise, generated from the dataclass itself."""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from serve_app.wire import flat

# What pickle writes without calling back into Python.
PLAIN = (str, int, float, bool, bytes, type(None))


def plain(value) -> bool:
    if type(value) in (list, tuple):
        return all(plain(v) for v in value)
    return type(value) in PLAIN


class Colour(enum.Enum):
    RED = "red"


@dataclass(slots=True)
class Leaf:
    a: int
    b: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Node:
    name: str
    leaf: Leaf
    leaves: list[Leaf]
    maybe: Leaf | None = None
    maybe_many: list[Leaf] | None = None
    colour: Colour | None = None
    anything: Any = None
    added_later: float = 0.5  # a field added to the class crosses with no other change


def test_a_dataclass_crosses_as_plain_tuples_and_comes_back_equal():
    pack, unpack = flat(Node)
    node = Node("n", Leaf(1, [(2, 0.5)]), [Leaf(3), Leaf(4)], None, [Leaf(5)], None, None, 2.5)
    packed = pack(node)
    assert type(packed) is tuple and plain(packed)
    assert packed[-1] == 2.5 and len(packed) == 8
    assert unpack(pickle.loads(pickle.dumps(packed))) == node
    # fields typed otherwise (an enum, Any) cross as they are
    other = Node("m", Leaf(1), [], Leaf(2), None, Colour.RED, {"x": RuntimeError("e")})
    back = unpack(pickle.loads(pickle.dumps(pack(other))))
    assert back.colour is Colour.RED and str(back.anything["x"]) == "e" and back.maybe == Leaf(2)


def test_shared_lists_stay_shared():
    """Two fields holding one list (a streamed output's token_ids and new_token_ids) hold one
    list again after the crossing: pickle keeps the sharing inside one message."""
    from serve_app.engine.outputs import CompletionOutput

    pack, unpack = flat(CompletionOutput)
    tokens = [7]
    back = unpack(pickle.loads(pickle.dumps(pack(CompletionOutput(0, tokens, tokens)))))
    assert back.token_ids is back.new_token_ids


def test_a_field_outside_init_is_refused():
    @dataclass
    class Computed:
        a: int
        b: int = field(init=False, default=0)

    with pytest.raises(TypeError, match="__init__"):
        flat(Computed)
