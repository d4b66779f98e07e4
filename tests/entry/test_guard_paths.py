"""Object paths from Dynamo's source expressions (entry/guard_paths.py): the cached,
split-by-suffix reading gives exactly what parsing the whole expression gives."""

from __future__ import annotations

import pytest

from cachecompile.entry import guard_paths as gp

EXPRS = [
    "L['x']", "G['a'].b", "L['self']['x']", "L['x'].a[0][3]['q']", "L['x']['a.b']",
    "L['x']['a]b']", "L['x']['']", "L['x'].a.\u00e9", "L['x'].\u00e9",
    "list(dict.keys(G['m'].R))[0]",
    "dict.__getitem__(G['m'].R, list(dict.keys(G['m'].R))[1])['k'].x",
    "dict.__getitem__(G['m'].R, list(dict.keys(G['n'].R))[1])",   # two dicts: no path
    "type(L['self']).__mro__[1]", "dict(type(L['self']).__dict__)['f'].__code__",
    "___odict_getitem(L['self']._modules, 'lin')._parameters['weight']",
    "L['x'].size()[0]", "f(L['x']).a", "L['x'] + 1", "L['x'][-1]", "L['x'][01]",
    "L['x'][True]", "L['x'][1.5]", "L['x'][ 1 ]", "L['x'] .a", "L['a\\'b'].c",
    "G['__builtins_dict___0']['zip']", "L['x'].a[", "",
]


@pytest.mark.parametrize("expr", EXPRS)
def test_a_path_is_what_parsing_the_whole_expression_gives(expr: str) -> None:
    gp.path.cache_clear()
    first = gp.path(expr)
    assert first == gp._parse(expr), expr
    assert gp.path(expr) == first


def test_paths_share_their_prefixes() -> None:
    gp.path.cache_clear()
    assert gp.path("L['self']._modules['lin']._parameters['weight']") == (
        ("item", "self"), ("attr", "_modules"), ("item", "lin"), ("attr", "_parameters"),
        ("item", "weight"))
    # Each prefix was looked up on the way (the first step, L['self']._modules, parsed),
    # so a sibling path adds one entry and parses nothing.
    assert gp.path.cache_info().currsize == 4
    gp.path("L['self']._modules['lin']._parameters['bias']")
    assert gp.path.cache_info().currsize == 5
