"""Megatron's row length against dhp's gain: `--seq-length` is the longest context, M what one GPU holds.

Megatron's GPTDataset concatenates the corpus's documents (each ending in EOD) and cuts the stream into rows
of `--seq-length` tokens, cutting documents at row ends; under `--reset-position-ids --reset-attention-mask`
megatron-dhp trains each piece of a document in a row as one sequence. So no sequence is longer than a row:
where rows hold no more than M tokens, every sequence fits one rank, and dhp plans what static data
parallelism does. This bench packs WLB-LLM documents (the repository's real length sample) that way, at each
row length, the same tokens a step, and plans every step with dhp, with Megatron's static CP (the smallest CP
that holds a whole row, since any row may be one document), under the reference cost model (gpt7b-64) on the
given domain at TP 1; and dhp at its best TP against the static (TP, CP) layout a user would tune for the row
length, TP priced as `plan_quality.py --tuned` prices it (GPT-7B's terms, 90 % of the ideal speed-up a doubling).

    python bench/row_length.py [--rows 8192,32768,131072] [--tokens 1048576] [--ranks 16] [--steps 3]

Measured: docs/results.md#row-length-against-the-gain.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from plan_quality import GPT7B_TP  # bench/ is sys.path[0]
from rich.console import Console
from rich.table import Table
from tuning import tune_dhp

from megatron_dhp.cost import CostConfig, build_cost_model, simulate
from megatron_dhp.solver import PlannerContext, build_planner, run_planner
from megatron_dhp.solver.static import static_cp_size
from megatron_dhp.solver.static_best import tune_static
from megatron_dhp.workload.sample import Batch
from megatron_dhp.workload.synthetic import wlbllm_lengths


def packed_steps(seq_length: int, rows: int, steps: int, seed: int) -> list[Batch]:
    """`steps` batches of `rows` rows of `seq_length` tokens cut from a stream of WLB-LLM documents in random
    order, each row's pieces of documents as its sequences (GPTDataset's packing, one piece per document part)."""
    rng = np.random.default_rng(seed)
    documents = wlbllm_lengths()
    need = rows * steps * seq_length
    drawn = rng.choice(documents, size=int(need / documents.mean() * 1.2) + 16)
    while drawn.sum() < need:
        drawn = np.concatenate([drawn, rng.choice(documents, size=len(drawn))])
    ends = np.cumsum(drawn)
    cuts = np.unique(np.concatenate([ends[ends < need], np.arange(0, need + 1, seq_length)]))
    pieces = np.diff(cuts)  # document pieces, row by row: a row boundary is always a cut
    row_of = cuts[:-1] // seq_length
    return [Batch.from_lengths(pieces[(row_of >= s * rows) & (row_of < (s + 1) * rows)].tolist(), seed=s)
            for s in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8192,32768,131072", help="row lengths (--seq-length) to compare")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens a step (rows x row length)")
    parser.add_argument("--ranks", type=int, default=16, help="ranks of the dynamic domain")
    parser.add_argument("--max-tokens-per-rank", type=int, default=8192, metavar="M")
    parser.add_argument("--steps", type=int, default=3, help="steps per row length (their mean is shown)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-efficiency", type=float, default=0.9, help="the share of the ideal TP speed-up kept "
                        "per doubling, for the tuned columns (default 0.9)")
    args = parser.parse_args()
    base = replace(CostConfig.load("gpt7b-64"), world_size=args.ranks, max_tokens_per_rank=args.max_tokens_per_rank,
                   tp_efficiency=args.tp_efficiency, **GPT7B_TP)
    model = build_cost_model(base)
    table = Table(title=f"{args.tokens:,} tokens a step of WLB-LLM documents packed into rows, {args.ranks} ranks, "
                        f"M {args.max_tokens_per_rank:,}, gpt7b-64")
    for column in ("--seq-length", "rows", "sequences", "longest", "static CP", "dhp s", "static s", "dhp vs static",
                   "dhp best TP", "static-best (TP, CP)", "dhp best TP vs static-best"):
        table.add_column(column, justify="right")
    for seq_length in (int(x) for x in args.rows.split(",")):
        batches = packed_steps(seq_length, args.tokens // seq_length, args.steps, args.seed)
        context = PlannerContext(dataset_max_tokens=seq_length)  # any row may be one document
        cp = static_cp_size(seq_length, model.domain)
        times = {name: np.mean([simulate(run_planner(build_planner(name, context), b, model), model).step_time_s
                                for b in batches]) for name in ("dhp", "static")}
        tuned, own = tune_static(base, batches, longest=seq_length)[0], tune_dhp(base, batches)[0]
        table.add_row(f"{seq_length:,}", str(args.tokens // seq_length), f"{np.mean([len(b) for b in batches]):.0f}",
                      f"{max(int(b.lengths.max()) for b in batches):,}", str(cp), f"{times['dhp']:.2f}",
                      f"{times['static']:.2f}", f"{times['static'] / times['dhp']:.2f}x",
                      f"{own.step_s:.2f} s (TP {own.tp})", f"{tuned.step_s:.2f} s (TP {tuned.tp}, CP {tuned.cp})",
                      f"{tuned.step_s / own.step_s:.2f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
