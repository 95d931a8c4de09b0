"""Length sources, synthetic distributions and batch drawing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_dhp.errors import DhpError
from megatron_dhp.workload import (
    DISTRIBUTIONS,
    Batch,
    LengthSource,
    Sample,
    VisualItem,
    fit_to_domain,
    load_samples,
    truncate_sample,
)
from megatron_dhp.workload.synthetic import wlbllm_lengths


def test_json_array(tmp_path):
    p = tmp_path / "l.json"
    p.write_text("[5, 3, 7]")
    assert [(s.id, s.tokens) for s in load_samples(p)] == [(0, 5), (1, 3), (2, 7)]


def test_json_objects_with_images(tmp_path):
    p = tmp_path / "l.json"
    p.write_text(json.dumps([{"tokens": 900, "images": [256, 256]}, 40]))
    assert load_samples(p) == [Sample(0, 900, (VisualItem(256, 64), VisualItem(256, 64))), Sample(1, 40)]


def test_jsonl(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text('{"tokens": 10}\n\n{"tokens": 600, "images": [512]}\n7\n')
    assert load_samples(p) == [Sample(0, 10), Sample(1, 600, (VisualItem(512, 128),)), Sample(2, 7)]


def test_megatron_indexed_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "corpus"
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for n in (12, 3, 40):
        builder.add_document(torch.arange(n, dtype=torch.int32), [n])
    builder.finalize(str(prefix) + ".idx")
    expected = [Sample(0, 12), Sample(1, 3), Sample(2, 40)]
    assert load_samples(prefix) == expected
    assert load_samples(str(prefix) + ".idx") == expected


def test_indexed_dataset_without_bin(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"junk")
    with pytest.raises(DhpError, match="no .bin file"):
        load_samples(tmp_path / "x")


@pytest.mark.parametrize(
    "name,text,match",
    [
        ("missing.json", None, "does not exist"),
        ("empty.json", "", "is empty"),
        ("blank.json", "  \n", "is empty"),
        ("bad.json", "[1, 2,", "is not valid JSON"),
        ("obj.json", '{"a": 1}', "must hold a JSON array"),
        ("none.json", "[]", "empty array"),
        ("neg.json", "[4, -3]", "entry 1: length -3 must be a positive integer"),
        ("zero.json", "[0]", "entry 0: length 0 must be a positive integer"),
        ("float.json", "[2.5]", "entry 0: length 2.5 must be a positive integer"),
        ("str.json", '["12"]', "entry 0: length '12' must be a positive integer"),
        ("bool.json", "[true]", "entry 0: length True must be a positive integer"),
        ("badline.jsonl", '{"tokens": 3}\n{oops}\n', "line 2 is not valid JSON"),
        ("notokens.jsonl", '{"len": 3}\n', "has no 'tokens' key"),
        ("extra.jsonl", '{"tokens": 3, "x": 1}\n', "unknown key 'x'"),
        ("img.jsonl", '{"tokens": 300, "images": [0]}\n', "image token count 0"),
        ("imgbig.jsonl", '{"tokens": 300, "images": [1600]}\n', "images take 400 LLM tokens, more than the sample's 300"),
    ],
)
def test_bad_length_files(tmp_path, name, text, match):
    p = tmp_path / name
    if text is not None:
        p.write_text(text)
    with pytest.raises(DhpError, match=match):
        load_samples(p)


def test_a_bad_sample_gets_one_message_from_python_files_and_plans(tmp_path):
    with pytest.raises(DhpError) as direct:
        Sample(0, 300, (VisualItem.short(1600, 4),))
    (tmp_path / "s.jsonl").write_text('{"tokens": 300, "images": [1600]}\n')
    with pytest.raises(DhpError) as from_file:
        load_samples(tmp_path / "s.jsonl")
    with pytest.raises(DhpError) as from_plan:
        Sample.from_dict({"id": 0, "tokens": 300, "images": [1600]})
    assert str(direct.value).startswith("sample 0: images take 400 LLM tokens, more than the sample's 300")
    assert str(from_file.value).endswith(f"s.jsonl', line 1: {direct.value}")
    assert str(from_plan.value) == f"sample entry {{'id': 0, 'tokens': 300, 'images': [1600]}}: {direct.value}"


def test_sample_validation():
    with pytest.raises(DhpError, match="length 0 must be a positive integer"):
        Sample(0, 0)
    with pytest.raises(DhpError, match="sample id -1"):
        Sample(-1, 5)
    with pytest.raises(DhpError, match="the batch is empty"):
        Batch(())
    with pytest.raises(DhpError, match="sample id 3 appears twice"):
        Batch((Sample(3, 1), Sample(3, 2)))


def test_whole_file_is_one_batch_in_file_order(tmp_path):
    p = tmp_path / "l.json"
    p.write_text(json.dumps([9, 1, 4, 4]))
    batch = LengthSource.from_args(lengths=p).draw(global_batch=None, seed=3, capacity=100)
    assert batch.ids == [0, 1, 2, 3] and list(batch.lengths) == [9, 1, 4, 4]


def test_file_draw_is_seeded(tmp_path):
    p = tmp_path / "l.json"
    p.write_text(json.dumps(list(range(1, 200))))
    src = LengthSource.from_args(lengths=p)
    a = src.draw(global_batch=50, seed=7, index=2, capacity=10**6)
    b = src.draw(global_batch=50, seed=7, index=2, capacity=10**6)
    c = src.draw(global_batch=50, seed=7, index=3, capacity=10**6)
    assert a == b and a != c
    assert a.ids == list(range(50)) and len(set(a.lengths)) == 50  # without replacement


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_distributions_are_deterministic_and_valid(name):
    src = LengthSource.from_args(dist=name)
    a = src.draw(global_batch=300, seed=1, capacity=64 * 8192)
    assert a == src.draw(global_batch=300, seed=1, capacity=64 * 8192)
    assert len(a) == 300 and a.ids == list(range(300))
    assert all(s.tokens >= sum(i.llm for i in s.images) and s.tokens <= 64 * 8192 for s in a.samples)


def test_distribution_shapes():
    cap = 64 * 8192
    giant = LengthSource.from_args(dist="giant").draw(global_batch=512, seed=0, capacity=cap)
    assert int(giant.lengths.max()) == int(0.9 * cap) and np.sum(giant.lengths > 100_000) == 1
    mm = LengthSource.from_args(dist="multimodal").draw(global_batch=512, seed=0, capacity=cap)
    assert sum(1 for s in mm.samples if s.images) > 100
    bi = LengthSource.from_args(dist="bimodal").draw(global_batch=2000, seed=0, capacity=cap).lengths
    assert 0.1 < np.mean(bi >= 16384) < 0.2 and np.all((bi <= 2048) | (bi >= 16384))


def test_wlbllm_preset_is_the_real_list():
    lengths = wlbllm_lengths()
    assert len(lengths) == 99_519 and lengths.max() == 124_913 and lengths.min() == 1
    assert int(np.median(lengths)) == 3227


def test_source_needs_exactly_one_input_and_a_batch_size():
    with pytest.raises(DhpError, match="exactly one of"):
        LengthSource.from_args()
    with pytest.raises(DhpError, match="unknown distribution 'zipf'"):
        LengthSource.from_args(dist="zipf")
    with pytest.raises(DhpError, match="needs --global-batch"):
        LengthSource.from_args(dist="bimodal").draw(global_batch=None, seed=0, capacity=10)
    with pytest.raises(DhpError, match="--global-batch 0 must be a positive integer"):
        LengthSource.from_args(dist="bimodal").draw(global_batch=0, seed=0, capacity=10)


def test_fit_to_domain_errors_or_truncates():
    batch = Batch((Sample(0, 100), Sample(1, 5000, tuple(VisualItem.short(p, 1) for p in (1000, 3000, 900))), Sample(2, 4097)))
    with pytest.raises(DhpError, match=r"sample 1 has 5000 tokens but the whole domain holds at most 4096.*--truncate to cut 2"):
        fit_to_domain(batch, 4096)
    cut = fit_to_domain(batch, 4096, truncate=True)
    assert list(cut.lengths) == [100, 4096, 4096] and [i.enc for i in cut[1].images] == [1000, 3000]
    assert truncate_sample(Sample(0, 10), 20) == Sample(0, 10)


def test_the_published_distributions_match_their_papers():
    # FlexSP's Wikipedia, rebuilt from its percentiles, against the statistics it publishes besides them:
    # mean 1,014 tokens; 78.8 % of documents <= 1K holding 24.9 % of the tokens; 84.9 % of tokens <= 16K.
    wiki = LengthSource.from_args(dist="wikipedia").draw(global_batch=200_000, seed=0, capacity=10**7).lengths
    assert abs(wiki.mean() / 1014 - 1) < 0.03
    assert abs(np.mean(wiki <= 1024) - 0.788) < 0.01 and abs(wiki[wiki <= 1024].sum() / wiki.sum() - 0.249) < 0.01
    assert abs(wiki[wiki <= 16384].sum() / wiki.sum() - 0.849) < 0.01
    # Megatron's example: mu = ln(1024) - sigma^2 / 2, clipped to 128-8192 (mean ~907, a quarter at 128).
    dcp = LengthSource.from_args(dist="dcp-lognormal").draw(global_batch=200_000, seed=0, capacity=10**7).lengths
    assert abs(dcp.mean() - 907) < 10 and abs(np.mean(dcp == 128) - 0.26) < 0.01 and dcp.max() == 8192
    # DHP's burst: one 128K sample in about half the batches, fillers 512-4K.
    bursts = [LengthSource.from_args(dist="burst").draw(global_batch=128, seed=0, index=k, capacity=64 * 8192).lengths
              for k in range(200)]
    assert 0.4 < np.mean([b.max() == 131072 for b in bursts]) < 0.6
    assert all(np.sum(b > 4096) <= 1 and b.min() >= 512 for b in bursts)
