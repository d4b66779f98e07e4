"""The smallest module the in-process tests cache: one Linear and a tanh, seeded."""

from __future__ import annotations

import torch
from torch import nn


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))
