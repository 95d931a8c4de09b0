"""Functions the multi-process training tests run on every spawned rank (importable, results picklable).

One launch runs several trainers one after another, so the ranks' start-up is paid once; each trainer gets
a fresh model, optimizer and group pool, exactly as a separate `megatron-dhp train` run would.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from megatron_dhp.cost.fit import GridPoint
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.plan.plan import PlanGroup
from megatron_dhp.runtime import engine
from megatron_dhp.solver import PLANNERS, Planner, PlannerUnsupported, run_planner
from megatron_dhp.training.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from megatron_dhp.training.loop import Trainer
from megatron_dhp.training.timing import measure
from megatron_dhp.workload.sample import Batch

STEPS = 20
RESUME_AT = 10
PROFILE_GRID = [GridPoint(16, 1), GridPoint(32, 1), GridPoint(8, 1, 4), GridPoint(32, 2), GridPoint(64, 2),
                GridPoint(16, 2, 4)]

PROFILE_STEPS = 4


def tiny_config(*, nproc: int = 2, max_tokens_per_rank: int = 48, planner: str = "dhp", **run: object) -> TrainConfig:
    """A model and data small enough for many short runs: samples of ~8-96 tokens, static CP 2 on 2 ranks."""
    return TrainConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=64, vocab_size=64, max_sequence_length=128),
        data=DataConfig(source="wlbllm", length_scale=1 / 128, global_batch=8, seed=3, noise=0.1),
        train=RunConfig(steps=STEPS, lr=1e-2, min_lr=1e-3, warmup_steps=2, nproc=nproc, timeout_s=60, **run),
        dhp=DhpConfig(planner=planner, max_tokens_per_rank=max_tokens_per_rank, cost="tiny-gpt-cpu", truncate=True),
    )


def losses(records) -> list[float]:
    return [r.loss for r in records]


def two_rank_runs(config: TrainConfig, folder: str) -> dict:
    """static and dhp from scratch (dhp saving at step 10), dhp resumed at 10, then bad checkpoints."""
    out: dict = {"rank": dist.get_rank()}
    static = Trainer(config.with_overrides(dhp={"planner": "static"}))
    out["static_cp"] = static.static_cp
    out["static"] = static.train()
    # Plans from measured speeds follow the timings: a bitwise-equal resumption needs the closed loop off.
    fixed = {"planner": "dhp", "adaptive": False}
    saving = config.with_overrides(dhp=fixed, train={"save": folder, "save_interval": RESUME_AT})
    out["dhp"] = Trainer(saving).train()
    out["slowed"] = Trainer(config.with_overrides(dhp={"planner": "dhp", "slow_ranks": ("1:4.0",)})).train()
    resumed = Trainer(config.with_overrides(dhp=fixed))
    out["resumed_from"] = resumed.resume(str(Path(folder) / f"step_{RESUME_AT:06d}"))
    out["resumed"] = resumed.train()
    latest = Trainer(config)
    out["latest_step"] = latest.resume(folder)
    out["errors"] = _bad_checkpoints(config, Path(folder))
    out["profile"] = measure(config, PROFILE_GRID, reps=2, steps=PROFILE_STEPS)
    out["rank_dependent"] = _rank_dependent_run(config)
    out["failing_planner"] = _train_error(_registered(FailingPlanner, config))  # rank 0's error reaches all
    out["diverged"] = _diverged_after_broadcast(config)
    return out


class RankDependentPlanner(Planner):
    """A registered planner whose plan depends on the rank that solves it, as a MILP's under a time limit may:
    samples that fit one rank go round-robin starting at this rank, longer ones to a group of every rank."""

    name = "rank-dependent"

    def __init__(self) -> None:
        self.solves = 0

    def solve(self, batch: Batch, model) -> list[PlanGroup]:
        self.solves += 1
        n, cap = model.domain.world_size, model.domain.max_tokens_per_rank
        short = [s.id for s in batch.samples if s.tokens <= cap]
        long = tuple((s.id,) for s in batch.samples if s.tokens > cap)
        start = dist.get_rank()
        groups = [PlanGroup((r,), tuple((i,) for i in short[(r - start) % n::n])) for r in range(n)]
        return groups + [PlanGroup(tuple(range(n)), long, phase=1)] if long else groups


class FailingPlanner(Planner):
    """A registered planner that cannot plan any batch."""

    name = "failing"

    def solve(self, batch: Batch, model) -> list[PlanGroup]:
        raise PlannerUnsupported("this planner plans nothing")


def _registered(planner: type, config: TrainConfig) -> TrainConfig:
    """`config` with `planner` registered under its name in this rank's process (a user's own planner)."""
    PLANNERS[planner.name] = planner
    return config.with_overrides(dhp={"planner": planner.name})


def _rank_dependent_run(config: TrainConfig) -> dict:
    """Train under `RankDependentPlanner`: the fingerprint of the plan each step ran, how often this rank
    solved, and the plan this rank would have solved itself for the last batch."""
    trainer = Trainer(_registered(RankDependentPlanner, config))
    records, held = [], []
    for record in trainer.steps():
        records.append(record)
        held.append(trainer.last_plan.fingerprint())
    own = run_planner(RankDependentPlanner(), Batch(trainer.last_plan.samples), trainer.runtime.planner.model)
    return {"records": records, "held": held, "own": own.fingerprint(), "solves": trainer.runtime.planner.planner.solves}


def _train_error(config: TrainConfig) -> str:
    """The error training `config` from scratch raises on this rank."""
    try:
        Trainer(config).train()
    except DhpError as e:
        return str(e)
    return "no error"


def _diverged_after_broadcast(config: TrainConfig) -> str:
    """Rank 1 flips the broadcast plan's phase barrier before the plan check: every rank stops with its error."""
    broadcast = engine.broadcast_plan

    def tampered(solve, domain):
        plan = broadcast(solve, domain)
        return replace(plan, phase_barrier=not plan.phase_barrier) if dist.get_rank() == 1 else plan

    engine.broadcast_plan = tampered
    try:
        return _train_error(config)
    finally:
        engine.broadcast_plan = broadcast


def _bad_checkpoints(config: TrainConfig, folder: Path) -> dict[str, str]:
    """Try to load broken or foreign checkpoints; every rank reports the error it raised."""
    errors = {}
    good = folder / f"step_{RESUME_AT:06d}"
    cases = {
        "truncated": lambda d: (d / "rank1.pt").write_bytes((d / "rank1.pt").read_bytes()[:300]),
        "flipped": lambda d: _flip_a_byte(d / "rank1.pt"),
        "missing": lambda d: (d / "rank0.pt").unlink(),
        "bad_meta": lambda d: (d / "meta.json").write_text("{not json"),
    }
    for name, damage in cases.items():
        broken = folder / f"broken_{name}"
        if dist.get_rank() == 0:
            shutil.copytree(good, broken)
            damage(broken)
        dist.barrier()
        errors[name] = _load_error(config, broken)
    errors["other_model"] = _load_error(config.with_overrides(model={"hidden_size": 48}), good)
    errors["other_data"] = _load_error(config.with_overrides(data={"seed": 4}), good)
    errors["empty_folder"] = _load_error(config, folder / "nothing_here")
    return errors


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _load_error(config: TrainConfig, folder: Path) -> str:
    try:
        Trainer(config).resume(str(folder))
    except DhpError as e:
        return str(e)
    return "no error"


def single_process_run(config: TrainConfig, two_rank_checkpoint: str) -> dict:
    """One rank: the whole batch in one process; then a 2-rank checkpoint must be refused."""
    return {"single": Trainer(config).train(), "world_mismatch": _load_error(config, Path(two_rank_checkpoint))}


PP_STEPS = 6
PP_SAVE_AT = 3


def pipeline_runs(config: TrainConfig, folder: str) -> dict:
    """PP 2: static, then dhp saving at step 3, then dhp resumed from step 3 (each rank's stage file)."""
    from megatron.core import parallel_state

    out: dict = {"rank": dist.get_rank(), "stage": parallel_state.get_pipeline_model_parallel_rank()}
    out["static"] = Trainer(config.with_overrides(dhp={"planner": "static"})).train()
    fixed = {"planner": "dhp", "adaptive": False}  # bitwise resumption: plans must not follow the timings
    saving = config.with_overrides(dhp=fixed, train={"save": folder, "save_interval": PP_SAVE_AT})
    out["dhp"] = Trainer(saving).train()
    resumed = Trainer(config.with_overrides(dhp=fixed))
    resumed.resume(str(Path(folder) / f"step_{PP_SAVE_AT:06d}"))
    out["resumed"] = resumed.train()
    out["capacity"] = resumed.pipeline.capacity
    out["other_pp"] = _load_error(config.with_overrides(train={"pp": 1}), Path(folder))
    return out


def interleaved_runs(config: TrainConfig, folder: str) -> dict:
    """PP 2 x VPP 2: dhp saving at step 3, then resumed from step 3 (each rank's chunks in its stage file)."""
    fixed = {"planner": "dhp", "adaptive": False}  # bitwise resumption: plans must not follow the timings
    trainer = Trainer(config.with_overrides(dhp=fixed, train={"save": folder, "save_interval": PP_SAVE_AT}))
    out: dict = {"chunks": len(trainer.chunks), "describe": trainer.describe(), "dhp": trainer.train()}
    resumed = Trainer(config.with_overrides(dhp=fixed))
    resumed.resume(str(Path(folder) / f"step_{PP_SAVE_AT:06d}"))
    out["resumed"] = resumed.train()
    out["capacity"] = resumed.pipeline.capacity
    return out


def plain_run(config: TrainConfig) -> list:
    """One trainer of `config` from scratch."""
    return Trainer(config).train()


def family_runs(config: TrainConfig) -> dict:
    """dhp under allgather with the group family (its default) and with any groups (max_groups_per_rank 0), and
    under mixed (the default comm): the groups each pool created at start-up and after it, step by step."""
    out: dict = {}
    for name, comm, bound in (("family", "allgather", None), ("any", "allgather", 0), ("mixed", "mixed", None)):
        trainer = Trainer(config.with_overrides(dhp={"comm": comm, "max_groups_per_rank": bound}))
        records = trainer.train()
        out[name] = {"at_startup": trainer.runtime.pool.at_startup, "created": [r.groups_created for r in records],
                     "groups": {r.groups for r in records}, "losses": losses(records)}
    return out


def vlm_config(nproc: int) -> TrainConfig:
    """The tiny GPT behind a vision tower on the multimodal mix: images of 1+ tiles in most batches."""
    return tiny_config(nproc=nproc, max_tokens_per_rank=96 if nproc == 1 else 48).with_overrides(
        vision={"layers": 1, "hidden_size": 16, "num_attention_heads": 2},
        data={"source": "multimodal", "length_scale": 1 / 64}, train={"steps": 4})


def vlm_runs(config: TrainConfig) -> dict:
    """static and dhp under each encoder placement, from the same weights on the same batches."""
    out: dict = {}
    for planner, placement in (("static", "split"), ("dhp", "split"), ("dhp", "replicate"), ("dhp", "global")):
        trainer = Trainer(config.with_overrides(dhp={"planner": planner, "encoder_placement": placement}))
        out[planner, placement] = losses(trainer.train())
        out["images"] = sum(len(s.images) for k in range(config.train.steps) for s in trainer.pipeline.batch(k).samples)
    return out
