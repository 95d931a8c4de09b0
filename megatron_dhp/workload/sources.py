"""Length sources: files of per-sample lengths, and Megatron indexed datasets.

Supported inputs, chosen by file name:
- `*.json`: a JSON array of positive integers (or of `{"tokens": N, "images": [...]}` objects);
- `*.jsonl`: one `{"tokens": N, "images": [...]}` object (or a bare integer) per line;
`tokens` is the sample's LLM length (text and visual items); each image is either its encoder token count P
(the short form: one attention block, ceil(P / merge) LLM tokens) or `{"enc": P, "llm": Q, "blocks": [...]}`.
- a Megatron indexed-dataset prefix (`PREFIX.bin` + `PREFIX.idx`, or either file's path), read with
  megatron-core's own `IndexedDataset` reader.
Every malformed value raises `DhpError` naming the file, the position and an excerpt of the value; a file is
read by `files.read_text` (at most `files.LENGTHS_BYTES`, UTF-8) and parsed by `files.parse_json` (no NaN, no
number beyond int64).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.files import LENGTHS_BYTES, parse_json, read_text
from megatron_dhp.workload.sample import Sample, VisualItem

_FORMATS = "a JSON array of positive integers (.json), JSONL with {\"tokens\": N} per line (.jsonl), or a Megatron .bin/.idx prefix"


def load_samples(path: str | Path, *, merge: int = 4, max_samples: int | None = None) -> list[Sample]:
    """Read every sample of a length source, ids in file order; a short-form image of P encoder tokens takes
    ceil(P / merge) LLM tokens (`merge`, the cost config's key). A file of more than `max_samples` (a file taken
    whole as one batch) is refused once its entries are counted, before they are read as samples."""
    p = Path(path)
    prefix = _indexed_prefix(p)
    if prefix is not None:
        samples = _load_indexed(prefix)
        _check_count(p, len(samples), max_samples)
        return samples
    if not p.is_file():
        raise DhpError(f"length file {str(p)!r} does not exist; pass {_FORMATS}")
    text = read_text(p, what="length file", limit=LENGTHS_BYTES)
    if not text.strip():
        raise DhpError(f"length file {str(p)!r} is empty; it must hold at least one length")
    if p.suffix == ".jsonl":
        return _load_jsonl(p, text, merge, max_samples)
    return _load_json(p, text, merge, max_samples)


def too_many_samples(name: str, count: int, limit: int) -> DhpError:
    """The error for a length file of `count` samples taken whole as one batch of at most `limit`."""
    return DhpError(f"length file {name!r} holds {count:,} samples, more than a batch may hold ({limit:,}), and "
                    "without --global-batch it is taken whole as one batch; pass --global-batch B to draw batches "
                    "of B samples from it")


def _check_count(p: Path, count: int, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise too_many_samples(p.name, count, limit)


def _load_json(p: Path, text: str, merge: int, max_samples: int | None) -> list[Sample]:
    obj = parse_json(text, name=f"length file {str(p)!r}", fix=f"pass {_FORMATS}")
    if not isinstance(obj, list):
        raise DhpError(f"length file {str(p)!r} must hold a JSON array of lengths, not a {type(obj).__name__}")
    if not obj:
        raise DhpError(f"length file {str(p)!r} holds an empty array; it must hold at least one length")
    _check_count(p, len(obj), max_samples)
    return [_sample(p, f"entry {i}", i, item, merge) for i, item in enumerate(obj)]


def _load_jsonl(p: Path, text: str, merge: int, max_samples: int | None) -> list[Sample]:
    lines = text.splitlines()
    _check_count(p, sum(1 for line in lines if line.strip()), max_samples)
    samples: list[Sample] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        item = parse_json(line, name=f"length file {str(p)!r}, line {lineno}")
        samples.append(_sample(p, f"line {lineno}", len(samples), item, merge))
    return samples


def _sample(p: Path, where: str, sample_id: int, item: object, merge: int) -> Sample:
    """One sample from its file form (a length, or an object with tokens and images); `Sample` and
    `VisualItem` check the values."""
    images: object = ()
    if isinstance(item, dict):
        if "tokens" not in item:
            raise DhpError(f"length file {str(p)!r}, {where}: object {excerpt(item)} has no 'tokens' key")
        unknown = set(item) - {"tokens", "images"}
        if unknown:
            raise DhpError(f"length file {str(p)!r}, {where}: unknown key {excerpt(sorted(unknown)[0])} (allowed: tokens, images)")
        tokens, images = item["tokens"], item.get("images", ())
    else:
        tokens = item
    if not isinstance(images, (list, tuple)):
        raise DhpError(f"length file {str(p)!r}, {where}: 'images' must be a list of token counts, got {excerpt(images)}")
    try:
        return Sample(sample_id, tokens, tuple(VisualItem.from_obj(x, merge) for x in images))
    except DhpError as e:
        raise DhpError(f"length file {str(p)!r}, {where}: {e}") from None


def _indexed_prefix(p: Path) -> Path | None:
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    if p.with_suffix(p.suffix + ".idx").is_file() or Path(str(p) + ".idx").is_file():
        return p
    return None


def _load_indexed(prefix: Path) -> list[Sample]:
    if not Path(str(prefix) + ".bin").is_file():
        raise DhpError(f"indexed dataset {str(prefix)!r} has a .idx file but no .bin file beside it")
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # heavy import, only when used

    try:
        dataset = IndexedDataset(str(prefix))
        # Copy out of the memory map: it is closed when the dataset object is collected.
        lengths = np.array(dataset.sequence_lengths, dtype=np.int64)
        del dataset
    except Exception as e:  # a corrupt index fails deep inside numpy/struct
        raise DhpError(f"indexed dataset {str(prefix)!r} could not be read: {e}") from None
    if len(lengths) == 0:
        raise DhpError(f"indexed dataset {str(prefix)!r} holds no sequences")
    samples = []
    for i, n in enumerate(lengths.tolist()):
        try:
            samples.append(Sample(i, n))
        except DhpError as e:
            raise DhpError(f"indexed dataset {str(prefix)!r}, sequence {i}: {e}") from None
    return samples
