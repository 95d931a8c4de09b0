"""From Megatron's data loader to one planned step per `next()`: sequences, lengths, plan, dispatch.

Megatron's loader gives every data-parallel rank microbatches of `--micro-batch-size` rows (tensor-parallel
rank 0 of the first and the last pipeline stage read it). One step takes the K microbatches Megatron would
run (K is the count Megatron hands its schedule) on TP rank 0 of the first stage, cuts rows into sequences,
shares them with the other ranks of its model-parallel group (every stage moves the same tokens: the first
reads the input ids, the last the labels and loss mask, every stage the layout), gathers every length
over the domain, plans, and moves the tokens (the step engine, `runtime/engine.py`): the result is this
rank's `StepInputs`. The train iterator reads and gathers the next step too, so its plan is solved in the
background while this step trains.

The iterator sits inside a `RerunDataIterator` (it replaces the one Megatron put around the loader), so
Megatron's rerun state machine replays whole planned steps: a rerun runs the same microbatches on the same
groups without touching the loader, the planner or any collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core.rerun_state_machine import RerunDataIterator

from megatron_dhp.errors import DhpError
from megatron_dhp.megatron.metrics import StepLog
from megatron_dhp.megatron.state import DhpRuntime
from megatron_dhp.plan.plan import Plan
from megatron_dhp.runtime.step_data import StepInputs, TokenSample

logger = logging.getLogger(__name__)

Sequence = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One training sequence as (tokens, labels, loss_mask), each [L]."""


def sequences(batch: Mapping[str, torch.Tensor], *, split_documents: bool) -> list[Sequence]:
    """The sequences of one Megatron microbatch, row by row.

    A row is one sequence, as Megatron attends over it, unless the loader marks documents inside it:
    `cu_seqlens` (packed SFT, inter-document masking) or, with `split_documents`, restarting `position_ids`.
    A packed row's end padding is no sequence and no part of one (`_unpadded_length`): it is never planned.
    """
    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    out = []
    for row in range(tokens.shape[0]):
        for start, end in _document_bounds(batch, row, split_documents):
            out.append((tokens[row, start:end], labels[row, start:end], loss_mask[row, start:end]))
    return out


def _document_bounds(batch: Mapping[str, torch.Tensor], row: int, split_documents: bool) -> list[tuple[int, int]]:
    length = batch["tokens"].shape[1]
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is not None:
        # padded entries repeat the last boundary, and boundaries in the end padding collapse onto its start:
        # none marks a document
        end = _unpadded_length(batch, row)
        bounds = sorted({min(max(int(b), 0), end) for b in cu_seqlens.reshape(batch["tokens"].shape[0], -1)[row]})
    elif split_documents:
        starts = torch.nonzero(batch["position_ids"][row] == 0).view(-1).tolist()
        bounds = sorted({0, *starts, length})
    else:
        bounds = [0, length]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _unpadded_length(batch: Mapping[str, torch.Tensor], row: int) -> int:
    """A packed row's length without its end padding: the trailing run of one token id that is also the label
    and carries no loss.

    Megatron-LM's SFT dataset pads a row to --seq-length with the pad id as token and label (loss mask 0) and
    counts the padding into the last sequence of `cu_seqlens` (`SFTDataset.__getitem__`). Dropping it changes no
    loss: its loss mask is 0, and attention is causal, so no real token attends to it (upstream's THD attention
    neither). With eod equal to pad the last sequence's final eod goes too: it carries no loss either.
    """
    tokens, labels, loss_mask = batch["tokens"][row], batch["labels"][row], batch["loss_mask"][row]
    pad = tokens[-1]
    real = torch.nonzero((tokens != pad) | (labels != pad) | (loss_mask != 0)).view(-1)
    return int(real[-1]) + 1 if real.numel() else 0


class DocumentCheck:
    """After the first steps, one warning where every row was one sequence: no document boundaries, so dhp plans
    rows as static parallelism does (unless rows are longer than a rank holds)."""

    STEPS = 3
    """Steps read before the verdict."""

    def __init__(self, split_documents: bool) -> None:
        self.split_documents = split_documents
        self.rows = self.sequences = self.steps = 0

    def see(self, rows: int, sequences: int) -> None:
        """Count one step's rows and the sequences cut from them; warn once, after `STEPS` steps."""
        self.rows, self.sequences, self.steps = self.rows + rows, self.sequences + sequences, self.steps + 1
        if self.steps != self.STEPS or self.sequences > self.rows:
            return
        if self.split_documents:
            cause = ("no EOD token ends a document inside them: build the corpus with tools/preprocess_data.py "
                     "--append-eod, so that each document is its own sequence")
        else:
            cause = ("--reset-position-ids --reset-attention-mask are not given, so each row is trained whole: add "
                     "them (and a corpus built with --append-eod) so that each document is its own sequence")
        logger.warning("megatron-dhp: the first %d steps' %d rows were one sequence each: %s", self.STEPS, self.rows,
                       cause)


class StepIterator:
    """Yields this rank's `StepInputs` for each step; Megatron's schedule says how big a step is (`expect`)."""

    def __init__(self, source: Iterator | None, runtime: DhpRuntime, *, lookahead: bool) -> None:
        self.source = source
        """Megatron's loader iterator on the rank that reads it (`DhpRuntime.share_source`); None elsewhere."""
        self.runtime = runtime
        self.engine = runtime.steps.engine(source=self._read, lookahead=lookahead)
        """Gathers, plans (one step ahead with `lookahead`), checks, prepares groups, moves tokens; walks the step."""
        self.num_microbatches: int | None = None
        self.documents: DocumentCheck | None = None
        """Warns once where the first steps' rows hold one sequence each (`hooks.setup` sets it on rank 0)."""
        self.log = StepLog(log_plans=runtime.steps.config.log_plans, prints=dist.get_rank() == 0)
        """When its steps are logged, and where (`megatron.metrics`): the plan line of every step on rank 0 until
        `hooks.setup` sets Megatron's intervals, iteration and writers."""

    def __iter__(self) -> StepIterator:
        return self

    def expect(self, num_microbatches: int) -> None:
        """Set how many loader microbatches make one step (Megatron passes the count to its schedule)."""
        self.num_microbatches = num_microbatches

    def __next__(self) -> StepInputs:
        """The next planned step, dispatched. Collective over the world."""
        inputs = self.engine.next()
        if inputs is None:
            raise StopIteration
        self.log.advance()
        if self.log.line_due:
            logger.info("dhp plan: %s", self._plan_line(inputs.plan))
        if self.log.scalars_due:
            self.log.write(inputs.plan, loop=self.runtime.steps.planner.loop, plan_wait_s=self.engine.plan_wait_s)
        return inputs

    def _plan_line(self, plan: Plan) -> str:
        """The plan's summary, the group pool's, the groups on p2p and the closed loop's summary, in one line."""
        p2p = self.engine.groups_on_p2p(plan)
        p2p = f"; {p2p} groups outside the family on p2p" if p2p else ""
        loop = self.runtime.steps.planner.loop
        measured = f" | {loop.summary()}" if loop is not None and loop.adaptive else ""
        return f"{plan.summary()} | {self.runtime.steps.pool.summary()}{p2p}{measured}"

    def close(self) -> None:
        """Let go of Megatron's loader iterator, so that its worker processes shut down when nothing else holds
        it (`hooks.setup` calls it at exit)."""
        self.source = None

    def _read(self) -> list[TokenSample] | None:
        """The next step's sequences from the loader, on every model-parallel rank; None at the end. Collective
        over the model-parallel group."""
        if self.num_microbatches is None:
            raise DhpError("StepIterator.expect(num_microbatches) must run before the first step (the schedule does it)")
        found = None
        if self.source is not None:
            try:
                batches = [next(self.source) for _ in range(self.num_microbatches)]
            except StopIteration:
                batches = None
            if batches is not None:
                found = [s for b in batches for s in sequences(b, split_documents=self.runtime.split_documents)]
                if self.documents is not None:
                    self.documents.see(sum(len(b["tokens"]) for b in batches), len(found))
        found = _share_over_model_parallel(found, self.runtime)
        if found is None:
            return None
        domain, cap = self.runtime.steps.domain, self.runtime.max_sample_tokens
        # ids unique over the domain without a collective: k-th sequence of position p is k * N + p
        return [_token_sample(k * domain.size + domain.position, seq, cap) for k, seq in enumerate(found)]


def _token_sample(sample_id: int, seq: Sequence, cap: int | None) -> TokenSample:
    tokens, labels, loss_mask = (t[:cap] for t in seq)
    return TokenSample(sample_id, tokens.to(torch.int64), labels.to(torch.int64), loss_mask.float())


def _share_over_model_parallel(found: list[Sequence] | None, runtime: DhpRuntime) -> list[Sequence] | None:
    """The reading rank's sequences on every rank of its model-parallel group (one header, lengths and rows)."""
    if runtime.share_group is None:
        return found
    device = runtime.steps.domain.device if dist.get_backend(runtime.share_group) == "nccl" else torch.device("cpu")
    header = torch.tensor([-1 if found is None else len(found)], dtype=torch.int64, device=device)
    dist.broadcast(header, runtime.share_source, group=runtime.share_group)
    count = int(header)
    if count < 0:
        return None
    if found is not None:
        lengths = torch.tensor([len(s[0]) for s in found], dtype=torch.int64, device=device)
        rows = torch.cat([torch.stack([t.to(torch.int64) for t in s], 1) for s in found]).to(device)
    else:
        lengths = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(lengths, runtime.share_source, group=runtime.share_group)
    if found is None:
        rows = torch.empty(int(lengths.sum()), 3, dtype=torch.int64, device=device)
    dist.broadcast(rows, runtime.share_source, group=runtime.share_group)
    parts = rows.cpu().split(lengths.tolist())
    return [(p[:, 0], p[:, 1], p[:, 2]) for p in parts]


@dataclass(frozen=True)
class IteratorShape:
    """How Megatron-LM nests one split's data iterators, read from its arguments, never from the Python type: a
    list is either the model chunks of one loader or several validation sets, each with its own data."""

    chunks: bool = False
    """Virtual pipelining: one iterator per model chunk, every one over the same loader."""
    sets: int = 0
    """--multiple-validation-sets (the validation split): one iterator per set, this many; 0: one split."""

    @classmethod
    def of(cls, args: object, *, sets: int = 0) -> IteratorShape:
        """The shape of a split's iterators under Megatron-LM's parsed `args` (`sets`: the validation sets)."""
        return cls(chunks=getattr(args, "virtual_pipeline_model_parallel_size", None) is not None, sets=sets)


def wrap_data_iterator(iterator: object, runtime: DhpRuntime, *, lookahead: bool,
                       shape: IteratorShape = IteratorShape()) -> object:
    """Megatron's data iterator (a `RerunDataIterator`, None, or lists of them as `shape` says) as one of planned
    steps, in the same nesting.

    Ranks that do not read the loader get a step iterator even where Megatron gave them None (TP ranks other
    than 0, middle pipeline stages): they take part in every step's collectives and are sent their data.
    Under virtual pipelining Megatron builds a loader per model chunk; a planned step serves every chunk, so
    the list holds one step iterator over the first chunk's loader (the first stage reads it) V times. Several
    validation sets each get their own step iterator over their own loader.
    """
    if shape.sets:
        # a rank that reads no loader was handed None (or Nones): it runs every set's steps all the same
        sets = _nested(iterator, "validation set (--multiple-validation-sets)") or [None] * shape.sets
        return [wrap_data_iterator(it, runtime, lookahead=lookahead, shape=replace(shape, sets=False)) for it in sets]
    if shape.chunks:
        chunks = _nested(iterator, "model chunk (--virtual-pipeline-model-parallel-size)")
        return [wrap_data_iterator(chunks[0], runtime, lookahead=lookahead)] * len(chunks) if chunks else []
    if isinstance(iterator, list):
        raise DhpError(f"Megatron-LM handed megatron-dhp a list of {len(iterator)} data iterators where its arguments "
                       "ask for one (no virtual pipelining, one validation set); a training script that builds its own "
                       "iterators must nest them as Megatron-LM's pretrain() does")
    reads_loader = dist.get_rank() == runtime.share_source
    if iterator is None and reads_loader:
        return None
    source = iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator
    return RerunDataIterator(StepIterator(source if reads_loader else None, runtime, lookahead=lookahead))


def _nested(iterator: object, what: str) -> list:
    """A list level the arguments promise, or a clear error when the script built its iterators otherwise."""
    if iterator is None:
        return []
    if not isinstance(iterator, list):
        raise DhpError(f"Megatron-LM's arguments ask for a list of data iterators, one per {what}, and megatron-dhp "
                       f"was handed one {type(iterator).__name__}; build the iterators as Megatron-LM's pretrain() does")
    return iterator


def validation_sets(iterator: object, runtime: DhpRuntime) -> int:
    """How many validation sets the loader-reading rank of this model-parallel group was handed (the others get
    None from Megatron-LM). Collective over the model-parallel group."""
    count = [len(iterator) if isinstance(iterator, list) else -1]
    if runtime.share_group is not None:
        dist.broadcast_object_list(count, src=runtime.share_source, group=runtime.share_group)
    if count[0] < 1:
        raise DhpError("--multiple-validation-sets is given, but Megatron-LM's validation iterator is not a list of "
                       "sets; build the iterators as Megatron-LM's pretrain() does")
    return count[0]


def step_iterator(data_iterator: object) -> StepIterator:
    """The `StepIterator` inside what Megatron hands the schedule, or a clear error if it was never wrapped."""
    inner = getattr(data_iterator, "iterable", None)
    if not isinstance(inner, StepIterator):
        raise DhpError(
            "megatron-dhp is not set up: the data iterator given to the megatron-dhp schedule is not a planned-step "
            "iterator; call megatron_dhp.megatron.setup(args, train, valid, test) on every rank once the data "
            "iterators exist and hand the schedule the iterators it returns (the patches in patches/ do this in "
            "pretrain())"
        )
    return inner
