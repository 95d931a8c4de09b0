"""Functions the multi-process training tests run on every spawned rank (importable, results picklable).

One launch runs several trainers one after another, so the ranks' start-up is paid once; each trainer gets
a fresh model, optimizer and group pool, exactly as a separate `megatron-dhp train` run would.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from megatron_dhp.cost.fit import GridPoint
from megatron_dhp.errors import DhpError
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.training.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from megatron_dhp.training.loop import Trainer
from megatron_dhp.training.timing import measure

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
    saving = config.with_overrides(dhp={"planner": "dhp"}, train={"save": folder, "save_interval": RESUME_AT})
    out["dhp"] = Trainer(saving).train()
    resumed = Trainer(config.with_overrides(dhp={"planner": "dhp"}))
    out["resumed_from"] = resumed.resume(str(Path(folder) / f"step_{RESUME_AT:06d}"))
    out["resumed"] = resumed.train()
    latest = Trainer(config)
    out["latest_step"] = latest.resume(folder)
    out["errors"] = _bad_checkpoints(config, Path(folder))
    out["profile"] = measure(config, PROFILE_GRID, reps=2, steps=PROFILE_STEPS)
    return out


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
    saving = config.with_overrides(dhp={"planner": "dhp"}, train={"save": folder, "save_interval": PP_SAVE_AT})
    out["dhp"] = Trainer(saving).train()
    resumed = Trainer(config.with_overrides(dhp={"planner": "dhp"}))
    resumed.resume(str(Path(folder) / f"step_{PP_SAVE_AT:06d}"))
    out["resumed"] = resumed.train()
    out["other_pp"] = _load_error(config.with_overrides(train={"pp": 1}), Path(folder))
    return out


def plain_run(config: TrainConfig) -> list:
    """One trainer of `config` from scratch."""
    return Trainer(config).train()
