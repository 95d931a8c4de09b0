"""Where a plan runs the vision encoder: the placement names every layer reads.

A plan carries one (`Plan.encoder_placement`); the cost model prices each (`cost.encoder`), the planners
choose one (`auto`: `solver.encoder_auto`), the runtime runs it (`runtime.vision`).
"""

from __future__ import annotations

ENCODER_PLACEMENTS: dict[str, str] = {
    "split": "the sample's group spreads its images' blocks over its d ranks: encoder work / d (BENCHMARK.md §2)",
    "replicate": "every rank of the sample's group encodes all its images (upstream CP): encoder work not divided",
    "global": "blocks balanced over the whole domain, embeddings all-to-all to the LLM ranks, backward after the "
              "last microbatch",
    "auto": "plan under each of split, replicate and global and keep the lowest predicted step",
}
"""Encoder placements by name (the cost key `encoder_placement`), each with one line on what it does."""

CONCRETE_PLACEMENTS = ("split", "replicate", "global")
"""The placements a plan is priced and run with (`auto` resolves to one of them)."""
