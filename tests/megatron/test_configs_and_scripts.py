"""The shipped presets, and the two scripts."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_dhp.cost import CostConfig
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.megatron.arguments import add_dhp_args, dhp_config_from_args

REPO = Path(__file__).resolve().parents[2]
# What each preset promises its users, written out independently of the files (a changed preset must
# change this table too).
PRESETS = {
    "llama3_8b_dhp": dict(planner="dhp", max_tokens_per_rank=16384, effective_comm="allgather", layer_spec="te", cost="gpt7b-64",
                          gpus_per_node=8, truncate=False, max_groups=256),
    "gpt7b_64gpu": dict(planner="dhp", max_tokens_per_rank=8192, effective_comm="allgather", layer_spec="te", cost="gpt7b-64",
                        gpus_per_node=8, truncate=False, max_groups=512),
    "multimodal_dhp": dict(planner="dhp", max_tokens_per_rank=16384, comm="ring", layer_spec="local", cost="gpt7b-64",
                           gpus_per_node=8, truncate=True, max_groups=256),
}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_hold_what_they_promise(name):
    config = DhpConfig.load(REPO / "configs" / f"{name}.yaml")
    assert {key: getattr(config, key) for key in PRESETS[name]} == PRESETS[name]
    cost = CostConfig.load(config.cost)
    # Every preset plans with the GPT-7B reference model of docs/cost-model.md, encoder terms included.
    assert (cost.kind, cost.world_size, cost.gpus_per_node, cost.max_tokens_per_rank) == ("reference", 64, 8, 8192)
    assert (cost.attn_s_per_token2, cost.linear_s_per_token, cost.microbatch_overhead_s) == (5.128e-9, 1.84e-4, 0.05)
    assert (cost.enc_attn_s_per_token2, cost.enc_linear_s_per_token) == (2.0e-9, 6.0e-5)


def launch_command(**env: str) -> list[str]:
    out = subprocess.run([str(REPO / "scripts" / "pretrain_gpt_dhp.sh"), "--seed", "7"], check=True, capture_output=True,
                         text=True, env={**os.environ, "DRY_RUN": "1", "MEGATRON_LM": "/mlm", "DATA_PATH": "/data/c",
                                         "TOKENIZER_MODEL": "tok", "CHECKPOINT_DIR": "/ckpt", **env})
    return shlex.split(out.stdout)


def test_launch_script_is_a_complete_dhp_command():
    command = launch_command(NNODES="8", NODE_RANK="3", MASTER_ADDR="node0")
    text = " ".join(command)
    assert command[0] == "torchrun" and "--nproc-per-node 8 --nnodes 8 --node-rank 3 --master-addr node0" in text
    for expected in ("--num-layers 32", "--hidden-size 4096", "--num-attention-heads 32", "--num-query-groups 8",
                     "--ffn-hidden-size 14336", "--position-embedding-type rope", "--swiglu", "--bf16",
                     "--tensor-model-parallel-size 2", "--context-parallel-size 1", "--calculate-per-token-loss",
                     f"--dhp --dhp-config {REPO}/configs/llama3_8b_dhp.yaml"):
        assert expected in text, expected
    assert command[-2:] == ["--seed", "7"]  # extra arguments reach pretrain_gpt.py
    args, _ = add_dhp_args(argparse.ArgumentParser()).parse_known_args(command[command.index("pretrain_gpt.py") + 1:])
    config = dhp_config_from_args(args)
    assert config.layer_spec == "te"
    # the recipe can gain: its rows are longer than one rank holds, and its 8 nodes' domain holds a row
    seq_length = int(command[command.index("--seq-length") + 1])
    tp = int(command[command.index("--tensor-model-parallel-size") + 1])
    assert config.max_tokens_per_rank < seq_length <= 8 * 8 // tp * config.max_tokens_per_rank
    for documents in ("--reset-position-ids", "--reset-attention-mask", "--no-create-attention-mask-in-dataloader"):
        assert documents in command


def test_launch_script_runs_pretrain_gpt_through_the_launcher_with_dhp_hooks_import():
    plain = launch_command()
    hooked = launch_command(DHP_HOOKS="import")
    at = plain.index("pretrain_gpt.py")
    assert hooked[:at] == plain[:at] and hooked[at:at + 3] == ["-m", "megatron_dhp.megatron.run", "pretrain_gpt.py"]
    assert hooked[at + 3:] == plain[at + 1:]


def test_slurm_script_runs_one_torchrun_per_node_with_its_node_rank(tmp_path):
    # stand-ins for Slurm's commands: srun runs its command as node 1 would, scontrol names the nodes
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'SLURM_NODEID=1 exec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'nodeA\\nnodeB\\nnodeC\\nnodeD\\n'\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "4",
           "SLURM_JOB_NODELIST": "node[A-D]", "DRY_RUN": "1", "MEGATRON_LM": "/mlm", "DATA_PATH": "/data/c",
           "TOKENIZER_MODEL": "tok", "CHECKPOINT_DIR": "/ckpt"}
    out = subprocess.run([str(REPO / "scripts" / "slurm_pretrain_gpt_dhp.sbatch"), "--seed", "7"], capture_output=True,
                         text=True, env=env, check=True)
    command = shlex.split(out.stdout)
    assert "--nproc-per-node 8 --nnodes 4 --node-rank 1 --master-addr nodeA" in " ".join(command)
    assert command[-2:] == ["--seed", "7"]


def test_launch_script_names_what_is_missing():
    out = subprocess.run([str(REPO / "scripts" / "pretrain_gpt_dhp.sh")], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "MEGATRON_LM"})
    assert out.returncode != 0 and "set MEGATRON_LM" in out.stderr


def test_apply_patches_script_calls_the_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": ""}
    usage = subprocess.run([str(REPO / "scripts" / "apply_patches.sh")], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    out = subprocess.run([str(REPO / "scripts" / "apply_patches.sh"), str(tmp_path), "--check"], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 2 and "is not a Megatron-LM checkout" in out.stderr


def test_launch_script_and_nccl_ranks_set_the_cuda_and_nccl_defaults():
    """One table (`distributed.GPU_ENVIRONMENT`: split sharing, expandable allocator segments for new token counts
    every step, no NVLink SHARP buffers per communicator, TE's p2p on the group's communicator): the launch script
    exports each with its default (a user's own setting wins), and every NCCL rank megatron-dhp starts sets it."""
    import inspect

    from megatron_dhp.runtime import distributed

    script = (REPO / "scripts" / "pretrain_gpt_dhp.sh").read_text()
    for name, value in distributed.GPU_ENVIRONMENT.items():
        assert f'export {name}="${{{name}:-{value}}}"' in script, name
    assert "gpu_environment()" in inspect.getsource(distributed.init_distributed)


