"""dhp's draft loops compiled (`csrc/solver/draft.c`), where the install built them.

`pip install` compiles the C file as an optional extension; without a C compiler it is skipped and the
Python of `layout.choose_window`, `fill.fill_in_order` and `layout.fill_holes`, which the C follows operation
for operation, runs instead:
the same plans to the last bit, a few times slower on batches that need many drafts. `draft` is None then
(and tests set it to None to compare the two).
"""

from __future__ import annotations

from types import ModuleType

draft: ModuleType | None
try:
    from megatron_dhp.solver.dhp import _draft as draft
except ImportError:  # built without a C compiler
    draft = None
