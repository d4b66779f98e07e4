"""The transformers Llama that ``bench_compile.py --model hf`` runs, at module scope.

AOT precompile saves the compiled function with a reference to the module's class, which
must be importable by name in the loading process: a class built inside a function is
refused ("defined in local scope").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo.models import LlmRunner, tokens  # needs the path above


class HfPrefill(LlmRunner):
    """``prefill(input_ids)`` returns the logits: the method every mechanism runs."""

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(input_ids=input_ids, use_cache=False).logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.prefill(input_ids)


def build() -> tuple[HfPrefill, torch.Tensor]:
    """hidden 256, 4 layers, random weights (tests/zoo/models.py)."""
    model = HfPrefill("llama", hidden_size=256, intermediate_size=704, num_hidden_layers=4)
    return model, tokens(2, 64)
