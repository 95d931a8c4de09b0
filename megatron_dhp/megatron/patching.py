"""Applying, checking and reverting the Megatron-LM patch of `patches/` on an upstream checkout.

One patch per supported upstream tag; each only adds calls into `megatron_dhp.megatron`. The tag is read
from git (`git describe --exact-match`) when the checkout sits on a tag, else from
`megatron/core/package_info.py`, whose MAJOR.MINOR picks the series. Applying is idempotent: `git apply
--reverse --check` tells an applied tree from a clean one, and a tree that is neither is a conflict whose
message names the first file that differs and what to do about it.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megatron_dhp.errors import DhpError
from megatron_dhp.presets import shipped_file

SUPPORTED_TAGS = ("core_v0.16.1", "core_v0.19.0")
"""Upstream tags with a patch in patches/ (named TAG.patch)."""


@dataclass(frozen=True)
class Checkout:
    """A Megatron-LM source tree and the supported tag its patch is for."""

    path: Path
    """The checkout's root folder."""
    tag: str
    """The supported tag it is (one of `SUPPORTED_TAGS`)."""
    found_by: str
    """How the tag was found: `git tag` or `package_info X.Y.Z`."""

    @property
    def patch(self) -> Path:
        """The patch file for this checkout's tag."""
        return patch_file(self.tag)


def patch_file(tag: str) -> Path:
    """patches/TAG.patch from the source checkout, or from the installed share folder."""
    found = shipped_file("patches", f"{tag}.patch")
    if found is None:
        raise DhpError(f"the patch for {tag} is missing from this megatron-dhp install (looked for patches/{tag}.patch)")
    return found


def detect(path: str | Path) -> Checkout:
    """Find the supported tag of the Megatron-LM checkout at `path`; a clear error for anything else."""
    root = Path(path).expanduser().resolve()
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise DhpError(f"{str(path)!r} is not a Megatron-LM checkout (no megatron/core/package_info.py); "
                       "pass the folder that holds pretrain_gpt.py")
    described = _git(root, "describe", "--tags", "--exact-match", "HEAD")
    if described.returncode == 0 and described.stdout.strip() in SUPPORTED_TAGS:
        return Checkout(root, described.stdout.strip(), "git tag")
    version = _package_version(info)
    series = {tag.removeprefix("core_v").rsplit(".", 1)[0]: tag for tag in SUPPORTED_TAGS}
    tag = series.get(".".join(map(str, version[:2])))
    if tag is None:
        raise DhpError(
            f"Megatron-LM at {str(path)!r} is megatron-core {'.'.join(map(str, version))}, which megatron-dhp has no "
            f"patch for; supported tags: {', '.join(SUPPORTED_TAGS)} (git -C {path} checkout {SUPPORTED_TAGS[-1]})"
        )
    return Checkout(root, tag, f"package_info {'.'.join(map(str, version))}")


def apply(path: str | Path, *, check: bool = False, revert: bool = False) -> str:
    """Apply (or with `revert` remove) the checkout's patch; with `check` only report. Returns one line."""
    checkout = detect(path)
    name = f"{checkout.patch.name} on Megatron-LM {checkout.tag} ({checkout.found_by})"
    forward = _git_apply(checkout, "--check")
    reverse = _git_apply(checkout, "--check", "--reverse")
    if not revert and reverse.returncode == 0:
        return f"{name}: already applied, nothing to do"
    if revert and forward.returncode == 0:
        return f"{name}: not applied, nothing to revert"
    needed = reverse if revert else forward
    if needed.returncode != 0:
        raise DhpError(_conflict_message(checkout, needed.stderr, revert))
    if check:
        return f"{name}: {'reverts' if revert else 'applies'} cleanly"
    done = _git_apply(checkout, "--reverse") if revert else _git_apply(checkout)
    if done.returncode != 0:
        raise DhpError(_conflict_message(checkout, done.stderr, revert))
    return f"{name}: {'reverted' if revert else 'applied'} ({len(patched_files(checkout.patch))} files)"


def patched_files(patch: Path) -> list[str]:
    """The upstream files a patch changes, in patch order."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.MULTILINE)


def _conflict_message(checkout: Checkout, stderr: str, revert: bool) -> str:
    match = re.search(r"error: (?:patch failed: )?([^:\s]+):", stderr)
    where = match.group(1) if match else "one of " + ", ".join(patched_files(checkout.patch))
    if revert:
        return (f"cannot revert {checkout.patch.name} in {checkout.path}: {where} has changed since the patch was "
                f"applied; restore it with git -C {checkout.path} checkout {checkout.tag} -- {where}")
    problem = "is missing" if f"{where}: No such file or directory" in stderr else f"differs from Megatron-LM {checkout.tag}"
    return (f"{checkout.patch.name} does not apply to {checkout.path}: {where} {problem}; start from a clean "
            f"checkout of the tag (git -C {checkout.path} checkout {checkout.tag} -- {where}) or add the calls of "
            f"{checkout.patch} to {where} by hand")


def _package_version(info: Path) -> tuple[int, int, int]:
    text = info.read_text()
    parts = [re.search(rf"^{key}\s*=\s*(\d+)", text, flags=re.MULTILINE) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise DhpError(f"{info} does not define MAJOR, MINOR and PATCH; is this a Megatron-LM checkout?")
    return tuple(int(p.group(1)) for p in parts)


def _git_apply(checkout: Checkout, *flags: str) -> subprocess.CompletedProcess:
    """`git apply` with the patch's paths relative to the checkout, even inside a larger repository."""
    prefix = _git(checkout.path, "rev-parse", "--show-prefix")
    directory = [f"--directory={prefix.stdout.strip()}"] if prefix.returncode == 0 and prefix.stdout.strip() else []
    top = _git(checkout.path, "rev-parse", "--show-toplevel")
    cwd = Path(top.stdout.strip()) if top.returncode == 0 else checkout.path
    return subprocess.run(["git", "apply", *directory, *flags, str(checkout.patch)], cwd=cwd,
                          capture_output=True, text=True, check=False)


def _git(path: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise DhpError("git is not installed; megatron-dhp apply-patches runs git apply") from None
