"""`megatron-dhp doctor`: what this machine would run, in seconds and without a job.

One line per question a user has on a new machine, each marked ok, note or FAIL: torch and the GPU,
megatron-core (and a Megatron-LM checkout's version and hooks), TransformerEngine and flash-attn against the
floors megatron-dhp needs, the attention kernel every comm variant runs in bf16 and fp32 (and why not the ones
before it), the copy kernels (prebuilt, JIT-built or torch), and the environment a GPU job sets. Exits 1 when
a line is FAIL: what a job would refuse at start-up.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
from dataclasses import dataclass

OK, NOTE, FAIL = "ok", "note", "FAIL"


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    level: str
    """`OK`, `NOTE` (works, with something to know) or `FAIL` (a job would be refused)."""
    topic: str
    text: str

    def line(self) -> str:  # noqa: D102
        return f"[{self.level:4s}] {self.topic}: {self.text}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `doctor`."""
    p = sub.add_parser(
        "doctor",
        help="what this machine would run: torch, GPU, megatron-core, TE, flash-attn, kernels, environment",
        description="Report, in seconds and without starting a job, what megatron-dhp would run on this machine "
        "and what it would refuse. Exits 1 when a job would be refused.",
    )
    p.add_argument("--megatron-lm", metavar="PATH", help="also check this Megatron-LM checkout's version and hooks")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print every finding; 1 if any is FAIL."""
    findings = examine(args.megatron_lm)
    for finding in findings:
        print(finding.line())
    failed = [f for f in findings if f.level == FAIL]
    print(f"megatron-dhp doctor: {len(failed)} problem{'s' * (len(failed) != 1)}"
          + (f" ({', '.join(f.topic for f in failed)})" if failed else ""))
    return 1 if failed else 0


def examine(megatron_lm: str | None = None) -> list[Finding]:
    """Every finding, in the order a job meets them."""
    import torch

    cuda = torch.cuda.is_available()
    findings = [_torch(torch, cuda), _megatron_core()]
    if megatron_lm is not None:
        findings.append(_checkout(megatron_lm))
    findings += [_transformer_engine(), _flash_attn()]
    findings += [_attention("cuda")] if cuda else [_attention("cpu"), Finding(
        NOTE, "attention on a GPU", "not checked here (no CUDA device): run doctor on the GPU machine")]
    findings += [_copy_kernels(cuda), _environment()]
    return findings


def _torch(torch, cuda: bool) -> Finding:
    if not cuda:
        return Finding(NOTE, "torch", f"{torch.__version__}; no CUDA device (jobs run gloo ranks on the CPU)")
    props = torch.cuda.get_device_properties(0)
    return Finding(OK, "torch", f"{torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
                                f"{props.name} (compute capability {props.major}.{props.minor}, "
                                f"{props.total_memory / 2**30:.0f} GiB)")


def _megatron_core() -> Finding:
    from packaging.version import Version

    from megatron_dhp.megatron.patching import CHECKED

    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return Finding(FAIL, "megatron-core", f"not installed; pip install 'megatron-core>={CHECKED[0]}'")
    if Version(version) < Version(CHECKED[0]):
        return Finding(FAIL, "megatron-core", f"{version} is older than {CHECKED[0]}, the oldest megatron-dhp runs "
                                              f"with; pip install 'megatron-core>={CHECKED[0]}'")
    level, known = (OK, "a checked version") if version in CHECKED else (NOTE, f"checked: {', '.join(CHECKED)}")
    return Finding(level, "megatron-core", f"{version} ({known})")


def _checkout(path: str) -> Finding:
    from megatron_dhp.errors import DhpError
    from megatron_dhp.megatron import sites
    from megatron_dhp.megatron.patching import detect

    try:
        checkout = detect(path)
    except DhpError as e:
        return Finding(FAIL, "Megatron-LM", str(e))
    present = sites.applied(sites.read_sources(checkout.path))
    if present == sites.NAMES:
        return Finding(OK, "Megatron-LM", f"{checkout.name}: hooks in place")
    if present:
        return Finding(FAIL, "Megatron-LM", f"{checkout.name}: only some hooks ({', '.join(sorted(present))}); run "
                                            f"megatron-dhp apply-patches --megatron-lm {path} --revert, then apply")
    return Finding(NOTE, "Megatron-LM", f"{checkout.name}: no hooks yet; megatron-dhp apply-patches --megatron-lm "
                                        f"{path} (or run pretrain_gpt.py through python -m megatron_dhp.megatron.run)")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _transformer_engine() -> Finding:
    from packaging.version import Version

    from megatron_dhp.runtime.attention.te import TE_FLOORS

    floors = ", ".join(f"{kind} >= {floor}" for kind, floor in TE_FLOORS.items())
    version = _version("transformer-engine") or _version("transformer_engine")
    if version is None:
        return Finding(NOTE, "TransformerEngine", f"not installed: the local layer spec runs (the te one needs TE, "
                                                  f"--cp-comm-type {floors})")
    short = [kind for kind, floor in TE_FLOORS.items() if Version(version) < Version(floor)]
    if short:
        return Finding(NOTE, "TransformerEngine", f"{version}: below the floor of --cp-comm-type "
                                                  f"{' and '.join(short)} ({floors})")
    return Finding(OK, "TransformerEngine", f"{version} (floors: {floors})")


def _flash_attn() -> Finding:
    from packaging.version import Version

    from megatron_dhp.runtime.attention.flash import FLASH_ATTN_FLOOR

    version = _version("flash-attn") or _version("flash_attn")
    if version is None:
        return Finding(NOTE, "flash-attn", f"not installed: the flash backend needs >= {FLASH_ATTN_FLOOR} (auto uses "
                                           "torch's own varlen kernels without it)")
    if Version(version) < Version(FLASH_ATTN_FLOOR):
        return Finding(NOTE, "flash-attn", f"{version} is older than {FLASH_ATTN_FLOOR}: the flash backend refuses it")
    return Finding(OK, "flash-attn", f"{version} (floor {FLASH_ATTN_FLOOR})")


def _attention(device_type: str) -> Finding:
    """What `auto` runs for every comm variant on `device_type`, in bf16 and fp32, and why not the ones before."""
    import torch

    from megatron_dhp.plan.comm import COMM_VARIANTS
    from megatron_dhp.runtime.attention.kernels import AUTO_ORDER, kernel, resolve_name

    picks = []
    for dtype in (torch.bfloat16, torch.float32):
        chosen = resolve_name(device_type, dtype, 128)
        skipped = []
        for name in AUTO_ORDER.get(device_type, ("sdpa",)):
            if name == chosen:
                break
            skipped.append(f"not {name}: {kernel(name).applies(device_type, dtype, 128)}")
        picks.append(f"{str(dtype).removeprefix('torch.')} -> {chosen}" + (f" ({'; '.join(skipped)})" if skipped else ""))
    return Finding(OK, f"attention on this {'CPU' if device_type == 'cpu' else 'GPU'}", f"{'; '.join(picks)}; head size 128, the same kernel under every comm "
                                               f"variant ({', '.join(COMM_VARIANTS)}) with the local layer spec")


def _copy_kernels(cuda: bool) -> Finding:
    from megatron_dhp.runtime.fused import kernel_library

    if os.environ.get("MEGATRON_DHP_CSRC") == "0":
        return Finding(NOTE, "copy kernels", "torch (MEGATRON_DHP_CSRC=0)")
    library = kernel_library()
    if library is not None:
        return Finding(OK, "copy kernels", f"csrc, prebuilt at {library}")
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None:
        return Finding(NOTE, "copy kernels", "torch: no prebuilt library and no nvcc to build one (scripts/build_csrc.sh "
                                             "on a machine with nvcc, then MEGATRON_DHP_CSRC=PATH)")
    when = "at a job's start-up" if cuda else "at a GPU job's start-up"
    return Finding(NOTE, "copy kernels", f"csrc, JIT-built with nvcc {when} (scripts/build_csrc.sh prebuilds it)")


def _environment() -> Finding:
    from megatron_dhp.runtime.distributed import GPU_ENVIRONMENT

    parts = [f"{name}={value}" + (f" (yours kept: {os.environ[name]})" if os.environ.get(name, value) != value else "")
             for name, value in GPU_ENVIRONMENT.items()]
    return Finding(OK, "environment", f"a GPU job sets, where unset: {', '.join(parts)}")

