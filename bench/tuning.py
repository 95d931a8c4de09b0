"""dhp at its best fixed TP, the tuning step the benches set against `static-best`.

A user running dhp also picks one tensor-parallel degree for the whole run; `tune_dhp` tries every TP a user
would (`solver.static_best.tp_degrees`, each priced by the cost model at that t) and ranks them by dhp's mean
simulated step over the batches, as `solver.static_best.tune_static` ranks the static layouts that
`megatron-dhp simulate --tuned` shows. Imported by plan_quality.py (`--tuned`), published.py and tp_phase.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dhp.cost import CostConfig
from megatron_dhp.solver.dhp import DhpPlanner
from megatron_dhp.solver.static_best import Layout, models, steps
from megatron_dhp.workload.sample import Batch


def tune_dhp(base: CostConfig, batches: Sequence[Batch]) -> list[Layout]:
    """dhp at every TP degree whose memory holds, fastest first (`Layout.cp` 0: its groups change per step)."""
    layouts = [Layout(t, 0, steps(model, batches, DhpPlanner())) for t, model in models(base).items()]
    return sorted(layouts, key=lambda layout: (layout.step_s, layout.tp))
