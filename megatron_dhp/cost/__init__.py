"""Cost models: the time of a sample on a group of d ranks, memory feasibility, the lower bound."""

from megatron_dhp.cost.config import COST_KINDS, CostConfig, Domain
from megatron_dhp.cost.model import CostModel
from megatron_dhp.cost.reference import ReferenceCostModel
from megatron_dhp.cost.simulate import Timeline, simulate
from megatron_dhp.cost.tensor_parallel import per_position

# A profiled model has the reference model's form with coefficients fitted on this device.
COST_MODELS = {kind: ReferenceCostModel for kind in COST_KINDS}


def build_cost_model(config: CostConfig) -> CostModel:
    """The cost model named by `config.kind`, over the config's domain positions (`tensor_parallel`)."""
    return COST_MODELS[config.kind](per_position(config))


__all__ = [
    "COST_KINDS",
    "COST_MODELS",
    "CostConfig",
    "CostModel",
    "Domain",
    "ReferenceCostModel",
    "Timeline",
    "build_cost_model",
    "simulate",
]
