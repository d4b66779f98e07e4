"""The call signature's form, pinned: it is part of every entry's key, so a change to what
``signature`` returns (even an equal value built faster, as issue 53's did) would leave
every store's entries unreachable. A change here must be deliberate (and say so in the
CHANGELOG: stores are rebuilt)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cachecompile.key.signature import signature


class Sub(torch.Tensor):
    pass


CPU = torch.device("cpu")
F32, I64 = torch.float32, torch.int64


def _inference() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(2, 3)


CASES: dict[str, tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = {
    # name: (args, static form, dynamic form)
    "decode token": ((torch.zeros(1, 1, dtype=I64),),
                     (("T", I64, CPU, (1, 1), True, False, None),),
                     (("T", I64, CPU, (1, 1), True, False, None),)),
    "transposed": ((torch.zeros(2, 3).t(),),
                   (("T", F32, CPU, (3, 2), (1, 3), False, None),),
                   (("T", F32, CPU, (-1, -1), False, False, None),)),
    "size-1 column": ((torch.zeros(3, 4)[:, :1],),
                      (("T", F32, CPU, (3, 1), (4, 1), False, None),),
                      (("T", F32, CPU, (-1, 1), False, False, None),)),
    "inference tensor": ((_inference(),),
                         (("T", F32, CPU, (2, 3), True, True, None),),
                         (("T", F32, CPU, (-1, -1), True, True, None),)),
    "subclass": ((torch.zeros(2).as_subclass(Sub),),
                 (("T", F32, CPU, (2,), True, False, f"{__name__}.Sub"),),
                 (("T", F32, CPU, (-1,), True, False, f"{__name__}.Sub"),)),
    "scalars": ((3, 2.5, True, None, "x"),
                (("int", 3), ("float", 2.5), ("bool", True), ("NoneType", None), ("str", "x")),
                (("int", -1), ("float", None), ("bool", True), ("NoneType", None),
                 ("str", "x"))),
    "containers": (((torch.zeros(2, 2), 7), [torch.zeros(5)], {"b": 1, "a": torch.zeros(1)}),
                   (("tuple", (("T", F32, CPU, (2, 2), True, False, None), ("int", 7))),
                    ("list", (("T", F32, CPU, (5,), True, False, None),)),
                    ("dict", (("a", ("T", F32, CPU, (1,), True, False, None)),
                              ("b", ("int", 1))))),
                   (("tuple", (("T", F32, CPU, (-1, -1), True, False, None), ("int", -1))),
                    ("list", (("T", F32, CPU, (-1,), True, False, None),)),
                    ("dict", (("a", ("T", F32, CPU, (1,), True, False, None)),
                              ("b", ("int", 1)))))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_signature_keeps_its_form(name: str) -> None:
    args, static, dynamic = CASES[name]
    assert signature(args, {}, False) == static
    assert signature(args, {}, True) == dynamic
    assert signature(args, {"k": 1}, False) == (*static, ("kw", ("k", ("int", 1))))
