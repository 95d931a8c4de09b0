"""megatron-dhp on real Megatron-LM checkouts: the patches, the launch script's flags, CPU training runs.

Point MEGATRON_LM_DIR at a pristine checkout or at a folder holding several, or set MEGATRON_LM_DIR_<LABEL> per
checkout (MEGATRON_LM_DIR_0_16_1, MEGATRON_LM_DIR_main, ...); without one a test skips. Every test works on a
copy, never on the given tree. What imports `megatron.training` runs in a subprocess with the copy first on
PYTHONPATH (so its own megatron.core), and skips where it cannot import (0.16 and 0.17 import on Python 3.11,
0.18 onwards need 3.12). MEGATRON_LM_TRAIN=LABEL,... limits the training runs to those checkouts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import random
import re
import shlex
import shutil
import signal
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dhp.errors import DhpError
from megatron_dhp.launch.ranks import free_port
from megatron_dhp.megatron import sites
from megatron_dhp.megatron.patching import apply, detect, diff
from megatron_dhp.testing.megatron_recipe import tiny_gpt_flags

REPO = Path(__file__).resolve().parents[2]


def upstream_trees() -> dict[str, Path]:
    """Label (`0.16.1`, `main`, ...) -> a Megatron-LM checkout, from the environment."""
    found: dict[str, Path] = {}
    for key, value in sorted(os.environ.items()):
        if key.startswith("MEGATRON_LM_DIR_"):
            found[key.removeprefix("MEGATRON_LM_DIR_").replace("_", ".")] = Path(value)
    root = os.environ.get("MEGATRON_LM_DIR")
    if root:
        for c in [Path(root), *(sorted(p for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else [])]:
            try:
                found.setdefault(detect(c).version, c)
            except DhpError:
                continue
    return found


TREES = upstream_trees()
LABELS = list(TREES) or ["0.16.1"]
TRAINED = [label for label in LABELS if label in os.environ.get("MEGATRON_LM_TRAIN", ",".join(LABELS)).split(",")]


def tree_of(label: str) -> Path:
    if label not in TREES:
        pytest.skip(f"no Megatron-LM {label} checkout: set MEGATRON_LM_DIR (or MEGATRON_LM_DIR_{label.replace('.', '_')})")
    return TREES[label]


def copy_of(tree: Path, dest: Path, files: list[str] | None = None) -> Path:
    """A copy of the whole checkout (without .git), or of just `files` and package_info."""
    if files is None:
        shutil.copytree(tree, dest, ignore=shutil.ignore_patterns(".git", ".python-version"))
        return dest
    for rel in [*files, "megatron/core/package_info.py"]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / rel, dest / rel)
    return dest


def run_python(code: str, *, cwd: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{REPO}", **env})


def require_megatron_training(tree: Path) -> None:
    probe = run_python("import megatron.training.training", cwd=tree, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"megatron.training of {tree} does not import here: {probe.stderr.strip().splitlines()[-1]}")


@pytest.mark.parametrize("label", LABELS)
def test_hooks_go_into_a_pristine_tree_idempotently_and_revert(label, tmp_path):
    """Every site found by its code; applied twice, reverted to the original bytes; --diff is the same edit."""
    tree = tree_of(label)
    files = [f for f in sites.SITE_FILES if (tree / f).is_file()]
    copy = copy_of(tree, tmp_path / "mlm", files)
    originals = {f: (copy / f).read_text() for f in files}
    check = apply(copy, check=True)
    if "already in place" in check:
        pytest.fail(f"{tree} already has megatron-dhp's hooks; point MEGATRON_LM_DIR at a pristine checkout")
    assert "applies cleanly (7 hooks" in check
    patch = tmp_path / "dhp.patch"
    patch.write_text(diff(copy))
    assert "applied (7 hooks" in apply(copy)
    assert apply(copy).endswith("hooks already in place, nothing to do")
    hooked = {f: (copy / f).read_text() for f in files}
    for f in files:
        py_compile.compile(str(copy / f), doraise=True)
    assert sorted(n for t in hooked.values() for n in sites.applied_sites(t)) == sorted(s.name for s in sites.SITES)
    assert "reverted (7 hooks" in apply(copy, revert=True)
    assert {f: (copy / f).read_text() for f in files} == originals
    subprocess.run(["git", "apply", str(patch)], cwd=copy, check=True, capture_output=True)
    assert {f: (copy / f).read_text() for f in files} == hooked


@pytest.mark.parametrize("label", LABELS)
def test_launch_script_flags_pass_megatron_lm_validation(label, tmp_path):
    """The flags of scripts/pretrain_gpt_dhp.sh through Megatron-LM's parser, validate_args and ours."""
    tree = tree_of(label)
    require_megatron_training(tree)
    env = dict(os.environ, DRY_RUN="1", MEGATRON_LM=str(tree), DATA_PATH="/data/x", TOKENIZER_MODEL="t",
               CHECKPOINT_DIR=str(tmp_path), NNODES="4")
    command = shlex.split(subprocess.run([str(REPO / "scripts" / "pretrain_gpt_dhp.sh")], env=env, check=True,
                                         capture_output=True, text=True).stdout)
    out = validate_flags(tree, command[command.index("pretrain_gpt.py") + 1:], world_size=32)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT 16 2 te 16384" in out.stdout  # configs/llama3_8b_dhp.yaml: M 16K under 128K rows


def validate_flags(tree: Path, argv: list[str], *, world_size: int) -> subprocess.CompletedProcess:
    """`argv` through Megatron-LM's parser, its validate_args and megatron-dhp's validator; prints RESULT."""
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        import megatron.training.arguments as arguments
        arguments.get_device_arch_version = lambda: 9  # validate_args reads the GPU generation
        arguments.torch.cuda.get_device_capability = lambda *a: (9, 0)  # and --moe-grouped-gemm's
        import megatron_dhp.megatron as dhp
        sys.argv = ["pretrain_gpt.py", *{argv!r}]
        args = arguments.parse_args(dhp.with_dhp_args(None))
        arguments.validate_args(args, {{"tokenizer_type": "GPT2BPETokenizer"}})
        config = dhp.validate_dhp_args(args)
        print("RESULT", args.data_parallel_size, args.tensor_model_parallel_size, config.layer_spec, config.max_tokens_per_rank)
    """)
    return run_python(code, cwd=tree, WORLD_SIZE=str(world_size), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")


@pytest.mark.parametrize("tp", [1, 2])
def test_upstream_llama3_8b_example_passes_with_dhp_added_in_bf16(tp, tmp_path):
    """examples/llama/train_llama3_8b_h100_fp8.sh (TP 1, and at TP 2 with its --sequence-parallel), its
    flags as its torchrun receives them, plus --dhp: its fp8 is refused in one line (dynamic microbatches'
    row counts are not the multiples of 8 or 16 TransformerEngine's fp8 GEMMs need); without --fp8-format
    (bf16) Megatron-LM's validation and megatron-dhp's accept every other flag."""
    tree = tree_of("0.16.1")
    require_megatron_training(tree)
    argv = recipe_argv(tree, "examples/llama/train_llama3_8b_h100_fp8.sh", tmp_path, edit=("TP_SIZE=1", f"TP_SIZE={tp}"))
    assert "--sequence-parallel" in argv and "--use-distributed-optimizer" in argv and "--fp8-format" in argv
    out = validate_flags(tree, [*argv, "--dhp"], world_size=8)
    assert out.returncode != 0 and "--fp8-format" in out.stdout + out.stderr, out.stdout[-2000:]
    at = argv.index("--fp8-format")
    out = validate_flags(tree, [*argv[:at], *argv[at + 2:], "--dhp"], world_size=8)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RESULT {8 // tp} {tp} " in out.stdout


def recipe_argv(tree: Path, script: str, tmp_path: Path, *, edit: tuple[str, str] = ("", ""), **env: str) -> list[str]:
    """The pretrain_gpt.py arguments an upstream example script (its text with `edit` replaced) hands torchrun,
    run with a fake torchrun."""
    (tmp_path / "pretrain_gpt.py").touch()  # scripts check that they run from a Megatron-LM root
    (tmp_path / "bin").mkdir()
    torchrun = tmp_path / "bin" / "torchrun"
    torchrun.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    torchrun.chmod(0o755)
    (tmp_path / "train.sh").write_text((tree / script).read_text().replace(*edit))
    env = {**os.environ, **env, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "ARGV_OUT": str(tmp_path / "argv")}
    subprocess.run(["bash", str(tmp_path / "train.sh"), "/ckpt", "tokenizer.model", "/data"], cwd=tmp_path, env=env,
                   check=True, capture_output=True)
    argv = (tmp_path / "argv").read_text().splitlines()
    return argv[argv.index("pretrain_gpt.py") + 1:]


def test_upstream_mixtral_example_passes_with_dhp_and_per_token_loss(tmp_path):
    """examples/mixtral/train_mixtral_8x7b_distributed.sh on 4 nodes (PP 4, EP 8, TP 1 with --sequence-parallel,
    grouped GEMM, the distributed optimizer): with --dhp added, the one problem is per-token loss, named with
    its fix; with it, both validations accept the run (grouped GEMM's compute-capability check stubbed: a GPU
    query)."""
    tree = tree_of("0.16.1")
    require_megatron_training(tree)
    argv = recipe_argv(tree, "examples/mixtral/train_mixtral_8x7b_distributed.sh", tmp_path, SLURM_NNODES="4")
    assert {"--expert-model-parallel-size", "--moe-grouped-gemm", "--use-distributed-optimizer"} <= set(argv)
    out = validate_flags(tree, [*argv, "--dhp"], world_size=32)
    assert out.returncode != 0 and "--dhp needs --calculate-per-token-loss" in out.stderr, out.stderr[-2000:]
    out = validate_flags(tree, [*argv, "--dhp", "--calculate-per-token-loss"], world_size=32)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT 8 1 local " in out.stdout


# A tiny GPT on mock data, small enough for 4 CPU ranks; every fusion off (they need CUDA or TE).
TINY = tiny_gpt_flags()
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask"]
# 64-token rows over at most 32 tokens per rank: every row runs on a context-parallel group
DHP = ["--dhp", "--dhp-max-tokens-per-rank", "32", "--dhp-log-plans", "--no-create-attention-mask-in-dataloader"]


def trainable(label: str, tmp_path_factory) -> Path:
    """A full copy of a checkout with megatron-core's compiled dataset helper, where this Python can train it:
    megatron-core of the same MAJOR.MINOR installed (its helper) and the checkout's megatron.training imports."""
    tree = tree_of(label)
    import megatron.core.datasets as installed
    import megatron.core.package_info as installed_version

    helper = next(Path(installed.__file__).parent.glob("helpers_cpp*.so"), None)
    series = detect(tree).version.rsplit(".", 1)[0]
    if helper is None or installed_version.__version__.rsplit(".", 1)[0] != series:
        pytest.skip(f"training Megatron-LM {label} needs megatron-core {series}.x installed with its compiled dataset helper")
    require_megatron_training(tree)
    copy = copy_of(tree, tmp_path_factory.mktemp("mlm") / "mlm")
    # a fresh mtime: Megatron's Makefile rebuilds the helper (which needs pybind11) when helpers.cpp is newer
    shutil.copy(helper, copy / "megatron" / "core" / "datasets" / helper.name)
    return copy


@pytest.fixture(scope="module", params=TRAINED)
def patched(request, tmp_path_factory) -> Path:
    """A trainable copy of each checkout, hooked by apply-patches."""
    copy = trainable(request.param, tmp_path_factory)
    apply(copy)
    return copy


CPU_SCRIPT = REPO / "scripts" / "megatron_lm_cpu.py"


def cpu_command(tree: Path, flags: list[str], *, script: Path = CPU_SCRIPT) -> tuple[list[str], dict[str, str]]:
    """torchrun of pretrain_gpt.py on 4 CPU ranks through the CPU shim (`script`), and its environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
               str(script), *flags]
    # FSDP asserts more than one CUDA connection (a GPU scheduling hint; nothing on the CPU reads it)
    connections = "2" if "--use-torch-fsdp2" in flags else "1"
    return command, {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
                     "CUDA_DEVICE_MAX_CONNECTIONS": connections}


def train_on_cpu(tree: Path, flags: list[str], *, full_log: bool = False, script: Path = CPU_SCRIPT,
                 **env: str) -> tuple[list[float], int | str]:
    """Losses that pretrain_gpt.py logs on 4 CPU ranks (training, then validation), and the plans logged (or,
    with `full_log`, the whole log)."""
    command, base = cpu_command(tree, flags, script=script)
    env = {**base, **env}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    log = out.stdout + out.stderr
    losses = [float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)]
    losses += [float(x) for x in re.findall(r"validation loss at iteration \d+.*?lm loss value: ([0-9.E+-]+)", log)]
    return losses, log if full_log else log.count("dhp plan: ")


MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"]
# id -> (extra Megatron-LM flags, extra --dhp flags)
RUNS = {
    # upstream masks attention between documents from the loader's masks; megatron-dhp runs each as a sequence
    "tp1-documents": ([*DOCUMENTS], []),
    # the second TP rank reads no loader and is sent its data
    "tp2-rows": (["--tensor-model-parallel-size", "2"], []),
    # every shard padded to an even row count; upstream's CPU norm needs the CPU shim for SP
    "tp2-sp-documents": (["--tensor-model-parallel-size", "2", "--sequence-parallel", *DOCUMENTS], []),
    # megatron-core's 1F1B runs each position's slots; the last stage is sent the first stage's data;
    # a rank holds M // 2 per microbatch, so 2 ranks x 64 // 2 hold a 64-token row
    "pp2-documents": (["--pipeline-model-parallel-size", "2", *DOCUMENTS], ["--dhp-max-tokens-per-rank", "64"]),
    # interleaved 1F1B: 2 chunks of one layer per stage; stage 0 keeps 5 chunks of 1/2 in flight, so a
    # microbatch holds 80 x 2 // 5 = 32 tokens per rank. Rows, not documents: upstream's get_batch gives the
    # chunks that are neither the first nor the last virtual stage no batch, so no attention mask, and those
    # attend across the documents of a row; megatron-dhp keeps each document apart in every chunk.
    "pp2-vpp2-rows": (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                       "--num-layers-per-virtual-pipeline-stage", "1"], ["--dhp-max-tokens-per-rank", "80"]),
    "distributed-optimizer": (["--use-distributed-optimizer", *DOCUMENTS], []),
    # torch FSDP2 shards weights, gradients and optimizer states over the domain; its per-layer gathers and
    # scatters run in every microbatch on the whole domain, so every rank runs the same slots (idle ones pad).
    # On 0.16.1 upstream's own FSDP2 step needs the CPU launcher's fix (finish_grad_sync's signature of 0.19).
    "torch-fsdp2-documents": (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", *DOCUMENTS], []),
    # megatron-core's MoE layer, experts split over EP groups of 2 carved from the domain: every rank runs the
    # same slots (idle ones pad), so the dispatcher's all-to-alls pair up while CP groups change
    "moe-ep2-alltoall": ([*MOE, "--moe-token-dispatcher-type", "alltoall", *DOCUMENTS], []),
    "moe-ep2-allgather": ([*MOE, "--moe-token-dispatcher-type", "allgather", *DOCUMENTS], []),
    # multi-token prediction: its tokens, positions, labels and loss mask roll across the dynamic groups' shards.
    # Rows, not documents: with --reset-attention-mask upstream rolls a row whole, so a document's last token
    # is trained on the next document's tokens; megatron-dhp runs each document as its own sequence and rolls
    # within it, as upstream does for packed (THD) sequences.
    "mtp-rows": (["--mtp-num-layers", "1"], []),
    "moe-ep2-pp2": ([*MOE, "--moe-token-dispatcher-type", "alltoall", "--pipeline-model-parallel-size", "2",
                     *DOCUMENTS], ["--dhp-max-tokens-per-rank", "64"]),
}


@pytest.mark.parametrize("run", RUNS)
def test_pretrain_gpt_with_dhp_trains_like_upstream(patched, run):
    """The patched pretrain_gpt.py with --dhp against itself without: same losses over 3 steps and evaluation."""
    extra, dhp_extra = RUNS[run]
    if "--mtp-num-layers" in extra and mtp_needs_transformer_engine(patched):
        pytest.skip("upstream's own MTP layer on this Megatron-LM needs TransformerEngine (without it the inference "
                    "linears it checks with isinstance are MagicMocks), with or without --dhp")
    if "--mtp-num-layers" in extra and mtp_rolls_lists(patched):
        command, env = cpu_command(patched, [*TINY, *extra, *DHP, *dhp_extra])
        out = subprocess.run(command, cwd=patched, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode != 0 and "megatron-dhp: --mtp-num-layers with --dhp: this megatron-core's" in out.stderr
        return  # refused in one line before the model is built (the dev branch's list-rolling MTP)
    upstream, plans_upstream = train_on_cpu(patched, [*TINY, *extra])
    dhp, plans = train_on_cpu(patched, [*TINY, *extra, *DHP, *dhp_extra])
    assert len(upstream) == 6 and plans_upstream == 0  # 3 training steps, 3 evaluations
    assert plans == 6  # one plan per training step and per evaluation step
    assert_same_training(dhp, upstream, extra)


def mtp_rolls_lists(tree: Path) -> bool:
    """Whether the checkout's MTP `roll_tensor` takes a list of tensors (the dev branch), which --dhp refuses."""
    source = (tree / "megatron" / "core" / "transformer" / "multi_token_prediction.py").read_text()
    return re.search(r"^def roll_tensor\(\s*tensors\b", source, flags=re.MULTILINE) is not None


def mtp_needs_transformer_engine(tree: Path) -> bool:
    """megatron-core 0.20's MTP layer asks `is_inference_column_parallel_linear`, an isinstance against classes
    that are MagicMocks where TransformerEngine is missing: a TypeError on any machine without TE."""
    layers = tree / "megatron" / "core" / "tensor_parallel" / "inference_layers.py"
    needs = layers.is_file() and "def is_inference_column_parallel_linear" in layers.read_text()
    return needs and importlib.util.find_spec("transformer_engine") is None


@pytest.fixture(scope="module", params=TRAINED)
def unpatched(request, tmp_path_factory) -> Path:
    """A trainable copy of each checkout, left as it is."""
    return trainable(request.param, tmp_path_factory)


@pytest.mark.parametrize("run", ["tp1-documents", "pp2-documents"])
def test_the_launcher_trains_an_unpatched_checkout_like_upstream(unpatched, run):
    """python -m megatron_dhp.megatron.run (here through the CPU shim's MEGATRON_DHP_HOOKS=import): the same
    hooks made in memory as the modules import, the checkout untouched, the losses upstream's."""
    extra, dhp_extra = RUNS[run]
    before = {f: (unpatched / f).read_text() for f in sites.SITE_FILES if (unpatched / f).is_file()}
    upstream, _ = train_on_cpu(unpatched, [*TINY, *extra])
    dhp, plans = train_on_cpu(unpatched, [*TINY, *extra, *DHP, *dhp_extra], MEGATRON_DHP_HOOKS="import")
    assert plans == 6 and len(upstream) == 6
    assert_same_training(dhp, upstream, extra)
    assert {f: (unpatched / f).read_text() for f in before} == before


def assert_same_training(got: list[float], want: list[float], flags: list[str]) -> None:
    """Losses equal at relative 2e-6. With MTP from megatron-core 0.17 on only the first (before any update): it
    weights each microbatch's MTP loss by its loss tokens before the roll over those after it
    (`original_num_tokens / num_tokens` in multi_token_prediction.py), a factor of how the batch is cut into
    microbatches, which no other layout (dynamic groups, or upstream's own at another --micro-batch-size)
    reproduces; the later losses then drift by up to ~5e-6 relative (measured on 0.17.1, 0.18.2 and 0.19.0)."""
    from megatron.core import package_info

    weighted = tuple(int(x) for x in package_info.__version__.split(".")[:2]) >= (0, 17)
    if "--mtp-num-layers" in flags and weighted:
        assert got[0] == pytest.approx(want[0], rel=2e-6) and got == pytest.approx(want, rel=3e-5), (got, want)
    else:
        assert got == pytest.approx(want, rel=2e-6), (got, want)


MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "32", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--rope-type", "rope"]


@pytest.mark.parametrize("extra", [[], ["--mtp-num-layers", "1", *MOE, "--moe-token-dispatcher-type", "alltoall"]],
                         ids=["mla", "deepseek-v3-like"])
def test_multi_latent_attention_on_dynamic_groups_trains_like_one_rank_per_row(patched, extra):
    """MLA (DeepSeek's attention, scaled down; and with MTP and MoE at EP 2, DeepSeek-V3's flags): upstream's own
    CPU run of the local MLA spec fails on 0.16.1 (its DotProductAttention does not take k_channels), so the
    reference is megatron-dhp's `static` planner with every 64-token row on one rank, no context parallelism;
    dhp runs the rows on CP groups."""
    gqa = TINY.index("--num-query-groups")  # MLA has no query groups
    flags = [f for f in TINY[:gqa] + TINY[gqa + 2:] if f != "--group-query-attention"] + [*MLA, *extra, *DHP]
    single, plans_single = train_on_cpu(patched, [*flags, "--dhp-planner", "static", "--dhp-max-tokens-per-rank", "64"])
    grouped, plans = train_on_cpu(patched, flags)
    assert len(single) == 6 and plans_single == plans == 6
    assert_same_training(grouped, single, flags)


def test_a_slowed_rank_is_named_in_the_plan_line_and_trains_like_upstream(patched, tmp_path):
    """--dhp-slow-rank 1:4.0 over 10 steps: the closed loop names rank 1 as the slowest in the plan lines once
    it has measured it, and every loss is upstream's. With --tensorboard-dir, Megatron's writer holds dhp's
    scalars beside its own, every --tensorboard-log-interval 2 of its iterations, the slow rank's speed among them.

    A slow rank shows only in groups apart from the others: with every row on a group of all four ranks
    (M = 32, as in the other tests) they all wait for it alike, as for a throttled GPU. The CPU's own cost
    model at M = 64 runs each row on one rank."""
    pytest.importorskip("tensorboard", reason="Megatron-LM's --tensorboard-dir needs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    longer = [*TINY[: TINY.index("--train-iters") + 1], "10", *TINY[TINY.index("--train-iters") + 2:], *DOCUMENTS]
    upstream, _ = train_on_cpu(patched, longer)
    apart = ["--dhp-max-tokens-per-rank", "64", "--dhp-cost", "tiny-gpt-cpu"]
    logged = ["--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "2"]
    dhp, log = train_on_cpu(patched, [*longer, *DHP, *apart, "--dhp-slow-rank", "1:4.0", *logged], full_log=True)
    assert dhp == pytest.approx(upstream, rel=2e-6), (dhp, upstream)
    # the plan summary lists slow ranks slowest first; 4 ranks share 2 cores, so others dip now and then
    slowest = re.findall(r"dhp plan: .*?slow (r\d+)@([0-9.]+)", log)
    assert slowest and slowest[-1][0] == "r1" and float(slowest[-1][1]) <= 0.5, slowest
    assert sum(rank == "r1" for rank, _ in slowest) >= 0.75 * len(slowest), slowest
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert sorted(scalars["dhp/sequences"]) == [2, 4, 6, 8, 10] == sorted(scalars["lm loss"])  # Megatron's own
    assert scalars["dhp/rank-speed-1"][10] <= 0.5 and scalars["dhp/slow-ranks"][10] >= 1
    assert scalars["dhp/measured-step-time"][10] > 0 and scalars["dhp/step-time-predicted"][10] > 0
    assert "dhp/attention-backend/text_summary" in events.Tags()["tensors"]


def test_flexsp_milp_is_planned_on_rank_zero_and_trains_like_upstream(patched, tmp_path):
    """A planner under a wall-clock limit (HiGHS may return different incumbents on different ranks): rank 0
    solves and broadcasts, so the plan check passes and the losses are upstream's."""
    config = tmp_path / "milp.yaml"
    config.write_text("planner: flexsp-milp\ntime_limit_s: 1.0\n")
    upstream, _ = train_on_cpu(patched, [*TINY, *DOCUMENTS])
    dhp, plans = train_on_cpu(patched, [*TINY, *DOCUMENTS, *DHP, "--dhp-config", str(config)])
    assert plans == 6
    assert dhp == pytest.approx(upstream, rel=2e-6), (dhp, upstream)


# FSDP2 in torch_dcp: upstream's own save of FSDP2 in the default torch_dist stops on 0.16.1 ("Param id 0 does not
# match any model sharded param", with or without --dhp)
SHARDED = {"distributed-optimizer": ["--use-distributed-optimizer"],
           "torch-fsdp2": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dcp"]}


@pytest.mark.parametrize("sharding", SHARDED)
def test_a_checkpoint_saved_under_dhp_resumes_with_or_without_it(patched, tmp_path, sharding):
    """Megatron-LM's --save/--load with the distributed optimizer or torch FSDP2: 2 steps under --dhp, saved;
    the run resumed with --dhp and without it gives upstream's own resumed losses (the loader restarts at the
    consumed samples, so the step planned ahead before the save is neither lost nor repeated)."""
    flags = [*TINY, "--train-iters", "4", "--eval-interval", "100", *SHARDED[sharding], *DOCUMENTS]
    saved = ["--save", str(tmp_path / "dhp"), "--save-interval", "2", "--exit-interval", "2"]
    up_saved = ["--save", str(tmp_path / "up"), "--save-interval", "2", "--exit-interval", "2"]
    first, _ = train_on_cpu(patched, [*flags, *DHP, *saved])
    train_on_cpu(patched, [*flags, *up_saved])
    shutil.copytree(tmp_path / "dhp", tmp_path / "dhp-off")
    upstream, _ = train_on_cpu(patched, [*flags, "--load", str(tmp_path / "up")])
    resumed, plans = train_on_cpu(patched, [*flags, *DHP, "--load", str(tmp_path / "dhp")])
    switched_off, _ = train_on_cpu(patched, [*flags, "--load", str(tmp_path / "dhp-off")])
    assert len(first) == 2 and len(upstream) == 4  # steps 1-2; then steps 3-4, validation and test
    assert plans == 4
    assert resumed == pytest.approx(upstream, rel=2e-6), (resumed, upstream)
    assert switched_off == pytest.approx(upstream, rel=2e-6), (switched_off, upstream)


def iteration_losses(log: str) -> dict[int, float]:
    """Training loss by iteration, as pretrain_gpt.py logs it."""
    return {int(i): float(x) for i, x in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)}


def test_exit_signal_handler_saves_exits_and_resumes_like_upstream(patched, tmp_path):
    """A scheduler's SIGTERM to torchrun under --dhp --exit-signal-handler: Megatron-LM saves at the iteration
    boundary and every rank exits on its own (no kill after torchrun's grace); the run resumed with --dhp
    logs the losses of upstream saved at that iteration and resumed."""
    flags = [*TINY, "--train-iters", "8", "--eval-interval", "100", *DOCUMENTS]
    command, env = cpu_command(patched, [*flags, *DHP, "--exit-signal-handler", "--save", str(tmp_path / "ckpt"),
                                         "--save-interval", "100"])
    run = subprocess.Popen(command, cwd=patched, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    log = []
    for line in run.stdout:
        log.append(line)
        if re.search(r"iteration\s+2/", line):
            run.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
            break
    log.append(run.communicate(timeout=300)[0])
    log = "".join(log)
    assert "exiting program after receiving SIGTERM" in log, log[-3000:]
    assert "forcefully exiting" not in log, log[-3000:]  # torchrun killed no rank: each exited by itself
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 8
    # upstream saved at the same iteration (by --exit-interval) and resumed: what a resumed run logs there
    up_saved = ["--save", str(tmp_path / "up"), "--save-interval", str(saved), "--exit-interval", str(saved)]
    train_on_cpu(patched, [*flags, *up_saved])
    _, upstream = train_on_cpu(patched, [*flags, "--load", str(tmp_path / "up")], full_log=True)
    _, resumed = train_on_cpu(patched, [*flags, *DHP, "--load", str(tmp_path / "ckpt")], full_log=True)
    upstream, resumed = iteration_losses(upstream), iteration_losses(resumed)
    assert sorted(resumed) == sorted(upstream) == list(range(saved + 1, 9))
    assert [resumed[i] for i in sorted(resumed)] == pytest.approx([upstream[i] for i in sorted(resumed)], rel=2e-6)


# Packed SFT (--sft): Megatron-LM's SFTDataset packs each JSONL line's conversations into one row of --seq-length,
# with cu_seqlens, and SFTTokenizer (--legacy-tokenizer: the new tokenizer system has no SFT type) tokenizes them
# with a Hugging Face tokenizer's chat template: here a character-level one built offline, with the specials of
# the nemotron-h-aligned prompt format (<SPECIAL_10> system, <SPECIAL_11> user and assistant, <SPECIAL_233> pad).
SFT_SPECIALS = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>"]
# each line: a conversation with a 2-letter question and a 3-letter answer, then one of 1 and 1. A conversation
# is "<SPECIAL_10>System\n\n" (9 tokens), "<SPECIAL_11>User\n{q}\n<SPECIAL_11>Assistant\n" (18 + q), "{a}\n"
# (a + 1) and the EOD SFTDataset adds: 34 and 31 tokens, 65 of a row of 80, the last 15 padding
SFT_CONVERSATIONS = [(2, 3), (1, 1)]
SFT_REAL_TOKENS = [34, 31]
SFT_SEQ_LENGTH = 80


def sft_tokenizer(path: Path) -> Path:
    """A character-level Hugging Face tokenizer (printable ASCII, an eos and the prompt format's specials)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    model = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>",
                            additional_special_tokens=SFT_SPECIALS).save_pretrained(path)
    return path


def sft_corpus(path: Path, lines: int = 40) -> Path:
    """SFTDataset's JSONL: each line's "messages" hold its conversations one after another, each opened by a
    system message."""
    rng = random.Random(0)

    def conversation(question: int, answer: int) -> list[dict[str, str]]:
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(n)) for n in (question, answer)]
        return [{"role": "system", "content": ""}, {"role": "user", "content": words[0]},
                {"role": "assistant", "content": words[1]}]

    path.write_text("".join(json.dumps({"messages": [m for q, a in SFT_CONVERSATIONS for m in conversation(q, a)]})
                            + "\n" for _ in range(lines)))
    return path


def without(flags: list[str], **drop: int) -> list[str]:
    """`flags` less each `--name` of `drop` (underscores for dashes) and the values it takes (its count)."""
    out, skip = [], 0
    for flag in flags:
        if skip:
            skip -= 1
        elif flag.startswith("--") and flag[2:].replace("-", "_") in drop:
            skip = drop[flag[2:].replace("-", "_")]
        else:
            out.append(flag)
    return out


def test_packed_sft_trains_like_upstream_and_plans_no_padding(patched, tmp_path):
    """pretrain_gpt.py --sft on a JSONL of two conversations a line: each row packs 65 real tokens and 15 of
    padding, which SFTDataset counts into the last sequence of cu_seqlens (tokens and labels the pad id, loss
    mask 0). Under --dhp the same 3 steps' losses as upstream, and every step plans exactly the conversations
    (dhp's scalars in Megatron's TensorBoard writer: 16 sequences, 8 x 65 tokens, the longest 34), no padding.

    Upstream's own --sft run stops on a CPU before its first step, with or without --dhp: RoPE's THD path gets
    the collated [1, n] cu_seqlens, and the local DotProductAttention refuses packed sequences. The reference
    run answers both with upstream's own code (megatron_dhp/testing/thd_reference.py), each conversation as a
    batch of one, as TransformerEngine's THD attention runs them.

    No evaluation: --sft makes Megatron-LM's evaluate() average loss / tokens per microbatch
    (training.py, `if args.sft`), a figure of how the batch is cut into microbatches: 0 / 0, NaN, for a planned
    microbatch without loss tokens (measured here: upstream 4.463169 at iteration 2, --dhp NaN)."""
    for module in ("transformers", "tokenizers", "datasets", "tensorboard"):
        pytest.importorskip(module, reason=f"Megatron-LM's --sft path (and this test) needs {module}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sft = [*without(tiny_gpt_flags(seq_length=SFT_SEQ_LENGTH), mock_data=0, tokenizer_type=1, vocab_size=1,
                    eod_mask_loss=0, micro_batch_size=1, eval_iters=1, split=1),
           "--sft", "--data-path", str(sft_corpus(tmp_path / "sft.jsonl")), "--split", "100,0,0",
           "--legacy-tokenizer", "--tokenizer-type", "SFTTokenizer",
           "--tokenizer-model", str(sft_tokenizer(tmp_path / "tokenizer")),
           "--micro-batch-size", "1",  # upstream's get_batch packs one row per microbatch
           "--no-create-attention-mask-in-dataloader", "--eval-iters", "0"]
    # the caller's PYTHONPATH after the checkout's: where Hugging Face's packages may be
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(patched), str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    upstream, _ = train_on_cpu(patched, sft, script=REPO / "megatron_dhp" / "testing" / "thd_reference.py", **env)
    logged = ["--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "1"]
    dhp, plans = train_on_cpu(patched, [*sft, *DHP, *logged], **env)
    assert len(upstream) == 3 and plans == 3
    assert dhp == pytest.approx(upstream, rel=2e-6), (dhp, upstream)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    rows = 8  # --global-batch-size
    assert scalars["dhp/sequences"] == [rows * len(SFT_REAL_TOKENS)] * 3
    assert scalars["dhp/longest-sequence"] == [max(SFT_REAL_TOKENS)] * 3  # with its padding, the last is 46
    assert [4 * t for t in scalars["dhp/tokens-per-rank-mean"]] == pytest.approx([rows * sum(SFT_REAL_TOKENS)] * 3)
