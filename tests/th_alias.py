"""A model whose module imports torch under another name (``import torch as th``): Dynamo
then installs the torch module its bytecode reads under a generated global
(``___module_torch_<id>_c0``), not ``torch`` (tests/e2e/test_float_inputs.py)."""

import torch as th
from torch import nn


class AliasScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        th.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.eps = 1e-6

    def run(self, x: th.Tensor) -> th.Tensor:
        h = self.lin(x)
        return h * th.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
