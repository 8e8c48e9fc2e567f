"""check_finite walks the validated request, not a second parse of the body:
every non-finite float is found, wherever it sits, and named by its JSON path."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from app.body import nonfinite_path

finite = st.floats(allow_nan=False, allow_infinity=False)
leaves = st.none() | st.booleans() | st.integers() | finite | st.text(max_size=5)
trees = st.recursive(
    leaves,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=3), kids, max_size=4)
    ),
    max_leaves=30,
)


def _containers(tree: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every list and dict in ``tree``."""
    out = []
    if isinstance(tree, (list, dict)):
        out.append(path)
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for key, item in items:
            out += _containers(item, (*path, key))
    return out


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


@given(trees)
def test_finite_trees_pass(tree):
    assert nonfinite_path({"x": tree}) is None


@given(trees, st.data(), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_one_nonfinite_float_is_found_at_its_path(tree, data, bad):
    root = {"x": tree}
    where = data.draw(st.sampled_from(_containers(root)))
    container = _at(root, where)
    if isinstance(container, dict):
        key = data.draw(st.text(alphabet="ab.", max_size=3))
        container[key] = bad
    else:
        key = len(container)
        container.append(bad)
    expected = ".".join(str(k) for k in (*where, key))
    assert nonfinite_path(root) == expected


class Inner(BaseModel):
    model_config = ConfigDict(extra="allow")
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")


class Outer(BaseModel):
    model_config = ConfigDict(extra="allow")
    tools: list[Inner] = []


def test_models_are_walked_by_json_names_and_extra_fields():
    body = Outer.model_validate_json(b'{"tools": [{}, {"schema": {"d": [1, NaN]}}]}')
    assert nonfinite_path(body) == "tools.1.schema.d.1"
    body = Outer.model_validate_json(b'{"tools": [{"extra": {"y": -Infinity}}]}')
    assert nonfinite_path(body) == "tools.0.extra.y"
    assert nonfinite_path(Outer.model_validate_json(b'{"z": 1e999}')) == "z"
    assert nonfinite_path(Outer.model_validate_json(b'{"z": [1e308, "NaN"]}')) is None
