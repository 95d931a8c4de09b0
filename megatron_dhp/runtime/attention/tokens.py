"""Which sample and position each row of a q/k/v tensor holds: what every local kernel masks by."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dhp.runtime.layout import MicrobatchLayout


@dataclass(frozen=True)
class Tokens:
    """Sample index and true position of each row of a q/k/v tensor."""

    positions: torch.Tensor
    segments: torch.Tensor
    whole_samples: MicrobatchLayout | None = None
    """Set when the rows are every slot of every sample of this layout, in group (rank-major) order:
    then they can be sorted into natural order for a varlen kernel."""
