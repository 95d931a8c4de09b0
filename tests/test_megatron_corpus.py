"""The dry run on a Megatron corpus (`--data-path`): its steps are the sequences a `--dhp` run plans.

The oracle is megatron-core itself, driven as Megatron-LM's `pretrain_gpt.py` drives it: the GPTDataset config of
`core_gpt_dataset_config_from_args` (NullTokenizer, reset position ids and attention mask, EOD loss mask),
`BlendedMegatronDatasetBuilder` with the train, valid and test sizes of the run, Megatron's sampler order, and
megatron-dhp's own `sequences(batch, split_documents=True)` on each microbatch.

Every document of the tiny corpus is one token id repeated, then EOD, so a token names its document and prefix.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_dhp.cli import main
from megatron_dhp.errors import DhpError
from megatron_dhp.workload.megatron_corpus import CorpusSpec, MegatronCorpus

VOCAB = 1000
EOD = VOCAB  # Megatron's NullTokenizer(--vocab-size V) ends documents with V
SEQ = 256
DOCS = {"web": 300, "books": 120}
"""Documents per prefix: web's are short (tokens 0..299), books' long (300..419), up to 2.7 rows."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two prefixes; document j of a prefix is its token id repeated, ending in EOD; books' many tokens would
    outweigh web's if a blend were drawn by size."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    first = 0
    prefixes = {}
    for name, count in DOCS.items():
        prefix = str(root / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        long = name == "books"
        for j in range(count):
            n = int(rng.integers(200, 700) if long else rng.integers(2, 120))
            doc = np.full(n, first + j, dtype=np.int64)
            doc[-1] = EOD
            builder.add_document(torch.from_numpy(doc), [n])
        builder.finalize(prefix + ".idx")
        prefixes[name] = prefix
        first += count
    return prefixes


def _megatron_train_dataset(data_path: list[str], *, train_iters: int, global_batch: int, split: str = "90,5,5",
                            seed: int = 1234):
    """Megatron-LM's train dataset for these flags, built as pretrain_gpt.py builds it."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=VOCAB)
    assert tokenizer.eod == EOD
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=SEQ, blend=get_blend_from_list(data_path), blend_per_split=None,
        split=split, path_to_cache=None, mmap_bin_files=True, tokenizer=tokenizer, reset_position_ids=True,
        reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=True)
    eval_iters = 2  # get_train_valid_test_num_samples: (train_iters // eval_interval + 1) * eval_iters rows
    sizes = [train_iters * global_batch, (train_iters // 5 + 1) * eval_iters * global_batch, eval_iters * global_batch]
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train


def _megatron_step_sequences(dataset, *, step: int, global_batch: int, micro_batch: int, data_parallel: int):
    """Per data-parallel rank, the sequences megatron-dhp's run cuts from step `step`: Megatron's sampler gives
    rank p rows [p * b, (p + 1) * b) of every slice of b x DP rows, collated into microbatches."""
    from torch.utils.data import default_collate

    from megatron_dhp.megatron.data import sequences

    out = [[] for _ in range(data_parallel)]
    first = step * global_batch
    for rank in range(data_parallel):
        for m in range(global_batch // (micro_batch * data_parallel)):
            start = first + m * micro_batch * data_parallel + rank * micro_batch
            batch = default_collate([dataset[i] for i in range(start, start + micro_batch)])
            batch = {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
            out[rank] += [tokens for tokens, _, _ in sequences(batch, split_documents=True)]
    return out


def _blend(corpus, a: float = 0.3, b: float = 0.7) -> list[str]:
    return [str(a), corpus["web"], str(b), corpus["books"]]


def test_first_step_is_the_sequences_a_dhp_run_plans(corpus):
    data_path, gbs, mbs, dp = _blend(corpus), 16, 2, 4
    spec = CorpusSpec(tuple(data_path), seq_length=SEQ, global_batch_size=gbs, micro_batch_size=mbs,
                      split="90,5,5", train_samples=10 * gbs, split_documents=True)
    dry = MegatronCorpus.open(spec, data_parallel=dp, steps=2)
    assert dry.eod == EOD and dry.eod_found
    megatron = _megatron_train_dataset(data_path, train_iters=10, global_batch=gbs)
    for step in (0, 1):
        expected = _megatron_step_sequences(megatron, step=step, global_batch=gbs, micro_batch=mbs, data_parallel=dp)
        got = dry.sequences(step)
        assert [[len(s) for s in seqs] for seqs in got] == [[len(s) for s in seqs] for seqs in expected]
        for mine, theirs in zip(got, expected):
            assert all(np.array_equal(a, b.numpy()) for a, b in zip(mine, theirs))
        # the run's sample ids: the k-th sequence of data-parallel rank p is k * N + p
        batch = dry.batch(step)
        assert {s.id: s.tokens for s in batch.samples} == {
            k * dp + p: len(s) for p, seqs in enumerate(expected) for k, s in enumerate(seqs)}
    lengths = dry.batch(0).lengths
    assert len(lengths) > gbs and lengths.max() <= SEQ  # documents cut at EODs and at row ends


def test_plan_command_writes_the_runs_first_step(corpus, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--data-path", *_blend(corpus), "--split", "90,5,5", "--seq-length", str(SEQ),
                 "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "10",
                 "--reset-position-ids", "--reset-attention-mask", "--world-size", "2", "--gpus-per-node", "2",
                 "--max-tokens-per-rank", "128", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    megatron = _megatron_train_dataset(_blend(corpus), train_iters=10, global_batch=8)
    expected = _megatron_step_sequences(megatron, step=0, global_batch=8, micro_batch=2, data_parallel=2)
    planned = {s["id"]: s["tokens"] for s in json.loads(out.read_text())["samples"]}
    assert planned == {k * 2 + p: len(s) for p, seqs in enumerate(expected) for k, s in enumerate(seqs)}
    assert "step 0 of 0.3 x web + 0.7 x books" in capsys.readouterr().out


@pytest.mark.parametrize("weights", [(0.3, 0.7), (0.8, 0.2)])
def test_blend_weights_decide_the_rows_of_each_prefix(corpus, weights):
    rows = 200
    spec = CorpusSpec(tuple(_blend(corpus, *weights)), seq_length=SEQ, global_batch_size=rows, split="90,5,5")
    dry = MegatronCorpus.open(spec, data_parallel=1, steps=1)
    web = sum(int(dry.tokens(i).min() < DOCS["web"]) for i in range(rows))  # a row is all one prefix's
    assert abs(web - weights[0] * rows) <= 1


def _documents_seen(corpus, split: str) -> set[int]:
    """The documents (token ids) of the first 4 steps of 64 rows: web's train part about 2 times over."""
    spec = CorpusSpec(tuple(_blend(corpus, 0.5, 0.5)), seq_length=SEQ, global_batch_size=64, split=split)
    dry = MegatronCorpus.open(spec, data_parallel=1, steps=4)
    return {int(t) for step in range(4) for _, row in dry.rows(step) for t in np.unique(dry.tokens(row)) if t != EOD}


def test_only_the_train_split_feeds_rows(corpus):
    train = set(range(round(0.9 * DOCS["web"]))) | {DOCS["web"] + j for j in range(round(0.9 * DOCS["books"]))}
    seen = _documents_seen(corpus, "90,5,5")
    assert seen <= train and len(seen) >= 0.9 * len(train)
    assert _documents_seen(corpus, "100,0,0") - train  # the same rows over the whole corpus reach the rest


def test_whole_rows_without_reset_attention_mask(corpus):
    spec = CorpusSpec((corpus["web"],), seq_length=SEQ, global_batch_size=8, split="90,5,5", split_documents=False)
    dry = MegatronCorpus.open(spec, data_parallel=2, steps=1)
    assert dry.eod is None
    assert dry.batch(0).lengths.tolist() == [SEQ] * 8


@pytest.mark.parametrize("data_path,match", [
    (["{web}", "{tmp}/missing"], "prefix '.*missing' has no .*missing.bin and no .*missing.idx"),
    (["{web}.bin"], r"without .bin or .idx"),
    (["0.3", "{web}", "{books}"], "weights and prefixes must come in pairs"),
    (["0.3", "{web}", "x", "{books}"], "weights and prefixes must come in pairs"),
    (["0", "{web}", "1", "{books}"], "every blend weight must be a positive number"),
])
def test_bad_data_path_is_one_clear_error(corpus, tmp_path, data_path, match):
    paths = [p.format(web=corpus["web"], books=corpus["books"], tmp=tmp_path) for p in data_path]
    with pytest.raises(DhpError, match=match):
        MegatronCorpus.open(CorpusSpec(tuple(paths), seq_length=SEQ, global_batch_size=8, split="90,5,5"),
                            data_parallel=1, steps=1)


def test_documents_without_eod_ask_for_eod_token(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "plain")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for j in range(20):
        builder.add_document(torch.full((50,), j, dtype=torch.int64), [50])
    builder.finalize(prefix + ".idx")
    spec = CorpusSpec((prefix,), seq_length=SEQ, global_batch_size=2, split_documents=True)
    with pytest.raises(DhpError, match="do not all end in one token.*--eod-token"):
        MegatronCorpus.open(spec, data_parallel=1, steps=1)


@pytest.mark.parametrize("args,match", [
    (["--global-batch-size", "8", "--split", "0,5,5"], "gives training no documents"),
    (["--global-batch-size", "8", "--reset-attention-mask"], "--reset-attention-mask needs --reset-position-ids"),
    (["--global-batch-size", "6"], "not divisible by --micro-batch-size 1 x 4 data-parallel ranks"),
    (["--global-batch-size", "8", "--global-batch", "8"], "--global-batch counts samples"),
    (["--global-batch-size", "8", "--train-iters", "1", "--batches", "2"], "need 16"),
    (["--reset-position-ids"], "--data-path needs --global-batch-size"),
])
def test_bad_corpus_flags_are_one_clear_line(corpus, capsys, args, match):
    code = main(["simulate", "--data-path", corpus["web"], "--seq-length", str(SEQ), "--world-size", "4",
                 "--planners", "static", *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and match in err, err


def test_corpus_flags_need_data_path(capsys):
    assert main(["simulate", "--seq-length", "4096", "--batches", "1", "--global-batch", "8"]) == 2
    assert "--seq-length is a flag of a Megatron corpus" in capsys.readouterr().err


def test_simulate_prints_the_predicted_step_and_speedups(corpus, tmp_path, capsys):
    js = tmp_path / "sim.json"
    code = main(["simulate", "--data-path", *_blend(corpus), "--split", "90,5,5", "--seq-length", str(SEQ),
                 "--global-batch-size", "16", "--train-iters", "10", "--reset-position-ids", "--reset-attention-mask",
                 "--world-size", "4", "--gpus-per-node", "4", "--max-tokens-per-rank", "64", "--batches", "2",
                 "--planners", "dhp,static", "--tuned", "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 0
    results = json.loads(js.read_text())["results"]
    dhp = np.mean([r["step_time_s"] for r in results["dhp"]])
    speedup = np.mean([s["step_time_s"] / d["step_time_s"] for s, d in zip(results["static"], results["dhp"])])
    tuned = np.mean([s["step_time_s"] / d["step_time_s"] for s, d in zip(results["static-best"], results["dhp"])])
    line = next(x for x in out.splitlines() if x.startswith("dhp: predicted step"))
    assert line == (f"dhp: predicted step {dhp:.3f} s (mean of 2); speed-up {speedup:.3f}x over static, "
                    f"{tuned:.3f}x over static-best")
    assert "2 steps of 16 rows" in out and "documents cut at EOD 1000 (read from the corpus)" in out
