"""dhp's draft loops compiled (`csrc/solver/draft.c`), where the install built them, and the rules that keep
them the Python's.

`pip install` compiles the C file as an optional extension; without a C compiler it is skipped and the
Python of `layout.choose_window`, `fill.fill_in_order`, `layout.fill_holes` and `scatter.list_schedules`
(with `scatter.list_placement`), which the C follows operation for operation, runs instead:
the same plans to the last bit, a few times slower on batches that need many drafts. `draft` is None then
(and tests set it to None to compare the two: tests/solver/test_draft_native.py checks each loop on random
inputs and the whole planner on random batches).

Tie-breaks and arithmetic
-------------------------
Both implementations keep these rules; they are stated here only, and the Python and draft.c name them by
their tags where they keep them. "Least" is over the key as written, compared lexicographically; floats are
IEEE doubles compared exactly (no tolerance but the ones stated); the C is built without FMA contraction.

Window choice (`layout.choose_window`, once per wide sample of `place_wide`; windows listed by size, then as
`Windows.of` lists them):

[W1] Within one size, the window of the least (order, cost, start), the first listed of equal keys. order is
     the window's finish; with `by`, where some window of that size finishes by it (finish <= by), 0 for
     those that do and 1 for the rest instead. cost is the window's waste; with `speeds` (which count only
     with `by`: the Python ignores them without it, and `native_choose_window` then gives the C none) its
     speed-weighted rank time.
[W2] Over sizes, narrowest first: a size's pick replaces the pick so far only where its finish is below the
     pick so far's finish x (1 - 1e-3).
[W3] Arithmetic: begin is the window's largest ready time; prefix sums run from rank 0, one addition per
     rank (numpy's cumsum); waste = size x begin - (prefix[end] - prefix[start]); finish = (begin + time) +
     overhead; the weighted cost = finish x capacity - (weighted[end] - weighted[start]), weighted the
     running sum of speed x ready.

Bins (`fill.BinSet`, `fill.fill_in_order`, `fill.improve`; a bin is a `DraftGroup`, its class its (size,
placement, speed), classes sorted by that key):

[B1] A class's bins are ordered by (finish, bin index); the makespan is the greatest (finish, bin index) of
     all bins.
[B2] Where a sample goes (`BinSet.best_bin`, skipping the `exclude` bin): in each class of at least its
     minimum degree, over the first `fill.SCAN` bins of [B1]'s order (an excluded bin counts), the first bin
     offers finish + t, plus m where none of its microbatches has room (a bin's room is its microbatches'
     largest, 0 without one; a load fits where load <= room). Where it has no room, the later bins that
     finish before the first's finish + m are looked at in order, and the first with room offers finish + t
     instead, where that (finish, bin) is less. Over the classes, the least (finish, bin): equal finishes go
     to the lower bin index whatever the class.
[B3] Into a group (`layout.add_to_group`: bins, wide groups and holes alike): the open microbatch of the
     least room that the load fits, the first of equals; else a new one, last, its room size x cap - load.
     A sample goes last in its microbatch; taking one out keeps the others' order, and an emptied
     microbatch goes (the rest keep theirs).
[B4] Arithmetic: a sample adds t to its group's finish, or (t + m), summed first, where it opens a
     microbatch; taken out it subtracts t, then m where its microbatch empties.
[B5] The LPT order (`fill.fill`, worked out in Python and handed to both): by work, then tokens, both
     decreasing, then by id.
[B6] Local moves (`fill.improve`): none once the makespan is <= floor_s or after max_moves moves. Else each
     sample of the makespan's bin [B1], by increasing index, is priced at max(makespan - saving, cost) (the
     first where equal): cost its finish at its best bin elsewhere [B2], saving its t, plus m where it is
     alone in its microbatch. A sample with such a bin and a price below makespan - 1e-12 may move; the
     least price moves, the lowest index of equals. None: the moves end.

Holes (`layout.fill_holes`; a hole is a rank's wait for its next wide group):

[H1] Worked out in Python and handed to both: holes numbered by (length, rank, start) decreasing; samples
     by their one-rank time t decreasing, then by id.
[H2] A sample of minimum degree 1 goes to the hole with the least time left >= t + m (m counted even where
     it joins an open microbatch), the lowest number of equals; else it is left. The hole's time left then
     drops by what its group's finish grew, and it is ranked again by (time left, number). The used holes'
     groups come back by number, the samples left by index.

List schedules (`scatter.list_schedules`, `scatter.list_placement`; each order from every rank free at 0, its
samples one after another, a sample of degree d with its seconds inside a node and across nodes and its
overhead):

[L1] The d ranks first by (ready, rank); begin is the d-th's ready; finish = (begin + t) + overhead, t the
     seconds inside a node where those d ranks are all on one node, else across nodes.
[L2] Where they span nodes and d <= gpus_per_node: in each node with at least d ranks, its d first by (ready,
     rank), start the d-th's ready and waste = d x start - (their readies summed in that order); the node of
     the least (start, waste, node). Its end (start + t inside) + overhead replaces [L1]'s where it is
     <= [L1]'s finish (and begin is then its start). The ranks taken are all ready at the finish after.
[L3] The order's end is the greatest finish, the first step to reach it its critical one; its waits are
     the sum, step by step, of each step's (begin - ready) over the ranks it takes, in rank order.
[L4] The level: the ranks' final readies ascending r_1..r_n, prefix sums from r_1; for k = 1.., level =
     ((spare - waits) + prefix_k) / k, the first k with level <= r_(k+1) (or k = n).
"""

from __future__ import annotations

from types import ModuleType

draft: ModuleType | None
try:
    from megatron_dhp.solver.dhp import _draft as draft
except ImportError:  # built without a C compiler
    draft = None
