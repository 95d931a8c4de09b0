"""A Megatron corpus as Megatron-LM feeds it: each step's training rows, cut into the sequences dhp plans.

Megatron-LM's `pretrain_gpt.py` packs the documents of its `--data-path` (`.bin`/`.idx` prefixes, with blend
weights or without) into rows of `--seq-length` (+1) tokens, keeps the train part of `--split`, shuffles with
`--seed`, and hands each data-parallel rank `--micro-batch-size` rows of every slice of the step's
`--global-batch-size` rows. Here megatron-core's own machinery does the same (`BlendedMegatronDatasetBuilder`,
`GPTDataset`, `BlendedDataset`, their compiled `helpers_cpp`), so the rows are Megatron's, in memory: nothing
is written beside the corpus or to a cache. Only the rows of the steps asked for are read from the `.bin`.

A megatron-dhp run with `--reset-attention-mask` (and `--reset-position-ids`) plans each document piece of a
row, where position ids restart, that is after every EOD token (`megatron_dhp/megatron/data.py`,
`sequences(batch, split_documents=True)`); without it each row is one sequence of `--seq-length` tokens.
Sample ids are the run's: the k-th sequence of data-parallel rank p is k * N + p.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_dhp.errors import DhpError, excerpt
from megatron_dhp.workload.sample import Batch, Sample

MEGATRON_SPLIT = "969, 30, 1"
"""Megatron-LM's `--split` when `--data-path` is given without one (`megatron/training/arguments.py`)."""

MEGATRON_SEED = 1234
"""Megatron-LM's default `--seed`: the seed of the document and row shuffles."""

MEGATRON_SURPLUS = 0.005
"""Megatron-LM's default `--mid-level-dataset-surplus`: rows each blended prefix builds beyond its share."""

EOD_PROBES = 1000
"""Documents per prefix whose last token is read to find the EOD token when none is given."""


@dataclass(frozen=True)
class CorpusSpec:
    """The data flags of a Megatron-LM run that decide which tokens each step holds, named as Megatron names
    them. Every value is checked here, before any file is opened."""

    data_path: tuple[str, ...]
    """`--data-path`: one prefix, prefixes, or `W1 PREFIX1 W2 PREFIX2 ...` (Megatron's `get_blend_from_list`)."""
    seq_length: int
    """`--seq-length`: the tokens of one row, the longest sequence the run can hold."""
    global_batch_size: int
    """`--global-batch-size`: rows per step, over every data-parallel rank."""
    micro_batch_size: int = 1
    """`--micro-batch-size`: rows each data-parallel rank reads at a time (decides which rank holds which row)."""
    split: str = MEGATRON_SPLIT
    """`--split`: train, valid, test weights; only the train part's documents feed training rows."""
    seed: int = MEGATRON_SEED
    """`--seed`: the shuffles of documents and rows."""
    train_samples: int | None = None
    """The run's training rows (`--train-samples`, or `--train-iters` x `--global-batch-size`): the epochs they
    need shape the shuffle, so rows equal the run's only with the run's value. None: the steps read."""
    split_documents: bool = False
    """`--reset-attention-mask`: each document piece of a row is one sequence (else a row is one)."""
    eod: int | None = None
    """The EOD token id where documents end; None: the token every document of the corpus ends with."""
    mid_level_dataset_surplus: float = MEGATRON_SURPLUS
    """`--mid-level-dataset-surplus`: extra rows each blended prefix builds (it changes their shuffles)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_path", tuple(str(p) for p in self.data_path))
        for flag, value in (("--seq-length", self.seq_length), ("--global-batch-size", self.global_batch_size),
                            ("--micro-batch-size", self.micro_batch_size)):
            if not _is_int(value) or value < 1:
                raise DhpError(f"{flag} {excerpt(value)} must be a positive integer")
        if self.train_samples is not None and (not _is_int(self.train_samples) or self.train_samples < 1):
            raise DhpError(f"--train-samples {excerpt(self.train_samples)} must be a positive integer")
        if self.eod is not None and (not _is_int(self.eod) or self.eod < 0):
            raise DhpError(f"--eod-token {excerpt(self.eod)} must be a non-negative token id")
        if not self.mid_level_dataset_surplus >= 0:
            raise DhpError(f"--mid-level-dataset-surplus {self.mid_level_dataset_surplus} must be >= 0")
        parse_blend(self.data_path)  # fail on a bad list before anything is read
        _train_fraction(self.split)

    def microbatches(self, data_parallel: int) -> int:
        """Microbatches per step on each of `data_parallel` ranks; Megatron's check on the batch sizes."""
        rows = self.micro_batch_size * data_parallel
        if self.global_batch_size % rows:
            raise DhpError(f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                           f"{self.micro_batch_size} x {data_parallel} data-parallel ranks (the domain's world size); "
                           f"pass a multiple of {rows}")
        return self.global_batch_size // rows


def parse_blend(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """`--data-path` as Megatron-LM reads it (`megatron.core.datasets.utils.get_blend_from_list`): an odd
    count or no numbers is prefixes alone, an even count of `weight prefix` pairs is a weighted blend. A list
    Megatron would misread (numbers mixed in, a weight that is not positive) is a `DhpError`."""
    items = list(data_path)
    if not items:
        raise DhpError("--data-path needs a prefix (PREFIX), prefixes, or weight-prefix pairs "
                       "(0.3 PREFIX_A 0.7 PREFIX_B)")
    numbers = [_number(x) for x in items]
    paired = len(items) % 2 == 0 and all(w is not None for w in numbers[0::2])
    if not paired and any(n is not None for n in numbers):
        raise DhpError(f"--data-path {excerpt(' '.join(items))}: weights and prefixes must come in pairs "
                       "(W1 PREFIX1 W2 PREFIX2 ...), or give prefixes alone")
    if paired and not all(math.isfinite(w) and w > 0 for w in numbers[0::2]):
        raise DhpError(f"--data-path {excerpt(' '.join(items))}: every blend weight must be a positive number")
    from megatron.core.datasets.utils import get_blend_from_list  # megatron-core's own reading of the list

    prefixes, weights = get_blend_from_list(items)
    return list(prefixes), None if weights is None else list(weights)


@dataclass(frozen=True)
class MegatronCorpus:
    """The train rows of a `CorpusSpec` for a domain of `data_parallel` ranks, built once by megatron-core;
    each step's sequences are read on demand. Build it with `open`."""

    spec: CorpusSpec
    data_parallel: int
    """The run's data-parallel ranks: the domain's world size N (TP and PP apart, CP 1 under dhp)."""
    steps: int
    """Steps 0 .. steps - 1 can be read."""
    eod: int | None
    """The EOD token the sequences are cut at (None: rows whole)."""
    eod_found: bool
    """Whether `eod` was read from the corpus rather than given."""
    train_rows: int
    """Rows the dataset was built for (the run's, or just the steps asked for)."""
    prefixes: list[str]
    weights: list[float] | None
    _dataset: object = field(repr=False)

    @classmethod
    def open(cls, spec: CorpusSpec, *, data_parallel: int, steps: int) -> MegatronCorpus:
        """Check the prefixes, find the EOD, and build Megatron's train dataset for at least `steps` steps."""
        if not _is_int(steps) or steps < 1:
            raise DhpError(f"the corpus must be read for at least one step, not {excerpt(steps)}")
        spec.microbatches(data_parallel)
        prefixes, weights = parse_blend(spec.data_path)
        for prefix in prefixes:
            _check_prefix(prefix)
        needed = steps * spec.global_batch_size
        train_rows = spec.train_samples if spec.train_samples is not None else needed
        if train_rows < needed:
            raise DhpError(f"the run trains on {train_rows:,} rows (--train-samples, or --train-iters x "
                           f"--global-batch-size) but {steps} step(s) of {spec.global_batch_size} rows need {needed:,}")
        eod, found = spec.eod, False
        if spec.split_documents and eod is None:
            eod, found = find_eod(prefixes), True
        _check_train_documents(prefixes, spec.split)
        dataset = _build_train_dataset(spec, prefixes, weights, train_rows)
        if len(dataset) < needed:  # a blend without weights takes one epoch of each prefix, no more
            raise DhpError(f"the train rows of --data-path are {len(dataset):,} (one epoch of each prefix: a blend "
                           f"without weights does not repeat), fewer than {steps} step(s) of "
                           f"{spec.global_batch_size} rows need ({needed:,}); plan fewer steps or give blend weights")
        return cls(spec, data_parallel, steps, eod if spec.split_documents else None, found, train_rows, prefixes,
                   weights, dataset)

    def rows(self, step: int) -> Iterator[tuple[int, int]]:
        """(data-parallel rank, row index) of every row of `step`, in the order each rank reads them: Megatron's
        sampler gives rank p rows [p * b, (p + 1) * b) of every slice of b x DP rows (`MegatronPretrainingSampler`)."""
        if not _is_int(step) or not 0 <= step < self.steps:
            raise DhpError(f"step {excerpt(step)} is not one of the {self.steps} step(s) the corpus was opened for")
        b, dp = self.spec.micro_batch_size, self.data_parallel
        first = step * self.spec.global_batch_size
        for rank in range(dp):
            for m in range(self.spec.microbatches(dp)):
                start = first + m * b * dp + rank * b
                yield from ((rank, row) for row in range(start, start + b))

    def tokens(self, row: int) -> np.ndarray:
        """The input tokens of one row (`--seq-length` ids, as the loader's `tokens`)."""
        return self._dataset[row]["tokens"].numpy()

    def sequences(self, step: int) -> list[list[np.ndarray]]:
        """Per data-parallel rank, the token ids of each of its sequences in `step`, in the order it reads them:
        each row cut after every EOD token (where Megatron's position ids restart), or whole."""
        out: list[list[np.ndarray]] = [[] for _ in range(self.data_parallel)]
        for rank, row in self.rows(step):
            tokens = self.tokens(row)
            if self.eod is None:
                out[rank].append(tokens)
            else:
                out[rank] += np.split(tokens, np.flatnonzero(tokens[:-1] == self.eod) + 1)
        return out

    def lengths(self, step: int) -> list[list[int]]:
        """Per data-parallel rank, the lengths of its sequences in `step`; whole rows read no token."""
        if self.eod is None:
            rows = [0] * self.data_parallel
            for rank, _ in self.rows(step):
                rows[rank] += 1
            return [[self.spec.seq_length] * n for n in rows]
        return [[len(s) for s in seqs] for seqs in self.sequences(step)]

    def batch(self, step: int) -> Batch:
        """The samples the run gathers and plans for `step`: the k-th sequence of rank p has id k * N + p."""
        n = self.data_parallel
        samples = [Sample(k * n + p, length) for p, lengths in enumerate(self.lengths(step))
                   for k, length in enumerate(lengths)]
        return Batch(tuple(sorted(samples, key=lambda s: s.id)))

    def describe(self) -> str:
        """One line on what the rows are: the blend, the split, the shapes and where sequences are cut."""
        blend = (" + ".join(f"{w:g} x {Path(p).name}" for w, p in zip(self.weights, self.prefixes)) if self.weights
                 else " + ".join(Path(p).name for p in self.prefixes))
        cut = ("rows whole (no --reset-attention-mask)" if self.eod is None else
               f"documents cut at EOD {self.eod}" + (" (read from the corpus)" if self.eod_found else ""))
        return (f"{blend}, split {self.spec.split}, seed {self.spec.seed}, --seq-length {self.spec.seq_length}, "
                f"{self.spec.global_batch_size} rows a step, {cut}")


def find_eod(prefixes: Sequence[str]) -> int:
    """The token the documents end with: a corpus preprocessed with `--append-eod` ends every document in its
    tokenizer's EOD. Reads the last token of up to `EOD_PROBES` documents of each prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ends: dict[int, int] = {}
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)  # held while its memory-mapped lengths are read
        lengths = dataset.sequence_lengths
        last = np.asarray(dataset.document_indices[1:]) - 1  # a document's last sequence ends in its EOD
        for i in np.unique(last[np.linspace(0, len(last) - 1, min(len(last), EOD_PROBES)).astype(np.int64)]):
            if lengths[i] > 0:
                token = int(dataset.get(int(i), offset=int(lengths[i]) - 1, length=1)[0])
                ends[token] = ends.get(token, 0) + 1
    if len(ends) != 1:
        common = ", ".join(f"{t} ({n})" for t, n in sorted(ends.items(), key=lambda kv: -kv[1])[:3])
        raise DhpError(f"the documents of --data-path do not all end in one token (last tokens: {common}), so the "
                       "corpus was not preprocessed with --append-eod or mixes tokenizers; pass --eod-token ID (your "
                       "tokenizer's EOD; NullTokenizer --vocab-size V: V), or drop --reset-attention-mask to plan "
                       "whole rows")
    return next(iter(ends))


def _build_train_dataset(spec: CorpusSpec, prefixes: list[str], weights: list[float] | None, rows: int) -> object:
    """Megatron's train dataset (a `GPTDataset`, or a `BlendedDataset` of them) as `pretrain_gpt.py` builds it,
    but only its train split, in memory (`path_to_cache` ""), with no masks built: they decide no token."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401  the compiled index builders
    except ImportError:
        raise DhpError("megatron-core's compiled dataset helper (megatron/core/datasets/helpers_cpp) is missing: the "
                       "megatron-core wheel ships it; a source checkout builds it with `make -C "
                       "megatron/core/datasets` (what Megatron-LM's initialize does)") from None
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=spec.seed, sequence_length=spec.seq_length, blend=(prefixes, weights), split=spec.split,
        path_to_cache="", tokenizer=_EodTokenizer(spec.eod), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mid_level_dataset_surplus=spec.mid_level_dataset_surplus)
    # The valid and test splits take other documents and do not change the train rows: not built.
    config.split_matrix = [config.split_matrix[0], None, None]
    with _quiet("megatron.core.datasets"):
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [rows, 0, 0], lambda: True, config).build()
    return train


@dataclass(frozen=True)
class _EodTokenizer:
    """What a GPTDataset asks of a tokenizer here: no pad (so no token is rewritten), no vocabulary size (the
    token width comes from the .idx), and an identity for its description."""

    eod: int | None
    vocab_size: None = None

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "megatron_dhp.workload.megatron_corpus._EodTokenizer", "eod": self.eod}


def _check_prefix(prefix: str) -> None:
    missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
    if missing:
        hint = " (give the prefix, without .bin or .idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise DhpError(f"--data-path prefix {prefix!r} has no {' and no '.join(prefix + m for m in missing)}{hint}")


def _train_fraction(split: str) -> float:
    """The train share of `--split`, read as megatron-core reads it."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        fractions = parse_and_normalize_split(split)
    except (AssertionError, ValueError, ZeroDivisionError):
        fractions = None
    if not fractions or not all(math.isfinite(f) for f in fractions):
        raise DhpError(f"--split {excerpt(split)} must be up to three non-negative weights, e.g. 90,5,5")
    if fractions[0] <= 0:
        raise DhpError(f"--split {excerpt(split)} gives training no documents; its first weight must be positive")
    return fractions[0]


def _check_train_documents(prefixes: list[str], split: str) -> None:
    """Every prefix's train part holds tokens (megatron-core would loop forever on an empty one)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    train = _train_fraction(split)
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)  # held: its memory map closes when it is collected
        lengths = dataset.sequence_lengths
        end = int(round(train * float(len(lengths))))  # megatron-core's bookends (blended_megatron_dataset_builder)
        if int(lengths[:end].sum(dtype=np.int64)) == 0:
            raise DhpError(f"--data-path prefix {prefix!r}: the train part of --split {split} holds no tokens "
                           f"({end} of its {len(lengths)} documents); raise the train weight or add documents")


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Hold a library's logger to errors (megatron-core logs every index it builds, and warns that none is
    cached, which is the point here)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
