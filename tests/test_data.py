"""Data package: readers on fixture files of every format, the real SST-2 / TREC files, the tokenizer
cache, padding, the batch sampler (determinism, sharding, resume) and every bad-input error."""

from __future__ import annotations

import csv
import gzip
import json
import logging
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import together, write_toy_sst2

import mhalab.data.datamodule as datamodule_module
from mhalab.data import (
    CLS_ID,
    PAD_ID,
    SPECIALS,
    Collate,
    EncodedSplit,
    LengthBatchSampler,
    TextClassificationDataModule,
    byte_tokenizer,
    encode_texts,
    load_tokenizer,
    padding_fraction,
    stratified_holdout,
)
from mhalab.data.reading import clean_rows, load_table
from mhalab.errors import ConfigError, DataError

DATA = Path(__file__).parents[1].parent / "shared/data"
SST2 = {
    "name": "sst2", "files": {"train": "sst2/train.tsv", "validation": "sst2/dev.tsv", "test": "sst2/test.tsv"},
    "text_column": "sentence", "label_column": "label", "num_classes": 2, "delimiter": "\t", "quoting": 3,
}
TREC_COARSE = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]

# ---------------------------------------------------------------------- fixture files

WORDS = ["good", "bad", "movie", "plot", "acting", "great", "awful", "fun", "boring", "the", "a", "was"]
SPECIAL_TEXTS = ['he said "hi", then left', "null", "NA", "  spaced  out  "]  # must survive every reader


def toy_rows(n: int, seed: int, labels=(0, 1)) -> list[tuple[str, object]]:
    rng = random.Random(seed)
    rows = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))), labels[i % len(labels)]) for i in range(n)]
    return [(t, rows[i][1]) for i, t in enumerate(SPECIAL_TEXTS)] + rows[len(SPECIAL_TEXTS):]


def write_rows(path: Path, rows, kind: str, columns=("text", "label")) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "tsv":  # like SST-2: no quoting at all, read back with quoting=3
        path.write_text("\t".join(columns) + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([columns, *rows])
    elif kind in ("jsonl", "jsonl.gz"):
        lines = "".join(json.dumps(dict(zip(columns, r))) + "\n" for r in rows)
        if kind == "jsonl":
            path.write_text(lines)
        else:
            with gzip.open(path, "wt") as f:
                f.write(lines)
    elif kind == "parquet":
        pq.write_table(pa.table({c: [r[i] for r in rows] for i, c in enumerate(columns)}), path)


FORMATS = {  # fixture kind -> reader arguments
    "tsv": {"format": "csv", "delimiter": "\t", "quoting": 3},
    "csv": {"format": "csv"},
    "jsonl": {"format": "json"},
    "jsonl.gz": {"format": "json"},
    "parquet": {"format": "parquet"},
}


def toy_data(tmp_path: Path, kind: str = "tsv", n=(40, 8, 8), labels=(0, 1), splits=("train", "validation", "test")):
    data_dir = tmp_path / "data"
    rows = {}
    for split, count, seed in zip(splits, n, range(3)):
        rows[split] = toy_rows(count, seed, labels)
        write_rows(data_dir / f"toy/{split}.{kind}", rows[split], kind)
    return data_dir, {s: f"toy/{s}.{kind}" for s in splits}, rows


def toy_dm(tmp_path: Path, kind: str = "tsv", write: bool = True, **kwargs) -> TextClassificationDataModule:
    """A datamodule over fixture files (written unless write=False) with a tiny tokenizer."""
    if write:
        toy_data(tmp_path, kind)
    data_dir, files = tmp_path / "data", {s: f"toy/{s}.{kind}" for s in ("train", "validation", "test")}
    args = dict(name="toy", files=files, num_classes=2, data_dir=str(data_dir), cache_dir=str(tmp_path / "cache"),
                vocab_size=100, min_frequency=1, max_len=16, batch_size=4, **FORMATS[kind])
    return TextClassificationDataModule(**(args | kwargs))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_format_reads_exactly_and_batches(tmp_path, kind):
    _data_dir, _files, rows = toy_data(tmp_path, kind)
    dm = toy_dm(tmp_path, kind)
    dm.setup()
    assert {s: len(d) for s, d in dm.splits.items()} == {"train": 40, "validation": 8, "test": 8}
    # Row order and texts survive reading (quotes, commas, 'null', 'NA'): ids equal a direct encode.
    texts, labels = zip(*rows["train"])
    assert [dm.splits["train"][i][0].tolist() for i in range(40)] == encode_texts(dm.tokenizer, texts, 16)
    assert dm.splits["train"].labels.tolist() == list(labels)
    batches = list(dm.val_dataloader())
    assert sorted(x for b in batches for x in b["labels"].tolist()) == sorted(r[1] for r in rows["validation"])
    for b in batches:
        n, width = b["input_ids"].shape
        assert b["input_ids"].dtype == torch.long and b["labels"].dtype == torch.long
        assert b["padding_mask"].dtype == torch.bool and b["padding_mask"].shape == (n, width)
        assert width == int(b["lengths"].max())  # dynamic padding: to the longest in the batch
        assert b["padding_mask"].sum(1).tolist() == (width - b["lengths"]).tolist()
        assert (b["input_ids"][b["padding_mask"]] == PAD_ID).all() and (b["input_ids"][:, 0] == CLS_ID).all()
        assert set(b) == {"input_ids", "padding_mask", "labels", "lengths", "num_tokens", "seqlens"}
        assert b["seqlens"].lengths == b["lengths"].tolist()
        assert b["num_tokens"] == int(b["lengths"].sum())  # the real tokens, a host int (no device sync)
    lengths = [int(x) for b in batches for x in b["lengths"]]
    assert lengths == sorted(lengths, reverse=True)  # evaluation batches: sorted by length


def test_string_labels_map_to_label_names_in_order(tmp_path):
    names = ["neg", "neu", "pos"]
    data_dir, files, rows = toy_data(tmp_path, "csv", labels=("pos", "neg", "neu"))
    dm = TextClassificationDataModule("toy3", files, label_names=names, data_dir=str(data_dir), format="csv",
                                      cache_dir=str(tmp_path / "cache"), vocab_size=100, min_frequency=1, max_len=16)
    dm.setup()
    assert dm.num_classes == 3 and dm.label_names == names
    assert dm.splits["train"].labels.tolist() == [names.index(r[1]) for r in rows["train"]]


def test_hydra_instantiates_it_from_yaml(tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    data_dir, files, rows = toy_data(tmp_path, "jsonl.gz", labels=("b", "a"))
    cfg = OmegaConf.create(f"""
    _target_: mhalab.data.TextClassificationDataModule
    name: toy
    data_dir: {data_dir}
    files: {{train: toy/train.jsonl.gz, validation: toy/validation.jsonl.gz, test: toy/test.jsonl.gz}}
    format: json
    label_names: [a, b]
    cache_dir: {tmp_path / "cache"}
    vocab_size: 100
    min_frequency: 1
    max_len: 16
    """)
    dm = instantiate(cfg)
    dm.setup()
    assert dm.files == files and dm.label_names == ["a", "b"] and dm.num_classes == 2
    assert dm.splits["train"].labels.tolist() == [["a", "b"].index(r[1]) for r in rows["train"]]


def test_fixed_len_pads_every_batch_to_max_len(tmp_path):
    dm = toy_dm(tmp_path, fixed_len=True)
    dm.setup()
    batches = list(dm.train_dataloader())
    assert {b["input_ids"].shape[1] for b in batches} == {16}
    lengths = torch.cat([b["lengths"] for b in batches]).float()
    assert padding_fraction(batches) == pytest.approx(1 - lengths.mean().item() / 16)


# ---------------------------------------------------------------------- real data: SST-2, TREC


@pytest.fixture(scope="session")
def sst2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("sst2_cache")
    dm = TextClassificationDataModule(**SST2, data_dir=str(DATA), cache_dir=str(cache), vocab_size=2000,
                                      batch_size=64, max_len=128)
    dm.prepare_data()
    dm.setup()
    return dm


def test_sst2_row_counts_and_label_balance(sst2):
    counts = {s: Counter(d.labels.tolist()) for s, d in sst2.splits.items()}
    assert {s: sum(c.values()) for s, c in counts.items()} == {"train": 67349, "validation": 872, "test": 1821}
    assert counts["train"] == {1: 37569, 0: 29780}
    assert counts["validation"] == {1: 444, 0: 428}
    assert counts["test"] == {1: 909, 0: 912}
    assert sst2.vocab_size == 2000 and sst2.num_classes == 2 and sst2.pad_id == 0


def test_sst2_second_setup_loads_cache_with_same_ids(sst2, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("should have been loaded from the cache")

    monkeypatch.setattr(datamodule_module, "train_tokenizer", fail)
    monkeypatch.setattr(datamodule_module, "encode_texts", fail)
    again = TextClassificationDataModule(**SST2, data_dir=str(DATA), cache_dir=str(sst2.cache_root), vocab_size=2000,
                                         batch_size=64, max_len=128)
    again.setup()
    assert again.tokenizer_json() == sst2.tokenizer_json()
    for split in ("train", "validation", "test"):
        assert torch.equal(again.splits[split].ids, sst2.splits[split].ids)
    # and a checkpoint's tokenizer JSON encodes exactly as the cached ids
    first = encode_texts(TextClassificationDataModule.tokenizer_from_json(sst2.tokenizer_json()),
                         ["hide new secretions from the parental units "], 128)[0]
    assert first == sst2.splits["train"][0][0].tolist()


def test_sst2_bucketing_cuts_padding(sst2):
    """Padding fraction of SST-2 train at batch 64: bucketed <= 10%, plain shuffled several times more."""
    bucketed = padding_fraction(sst2.train_dataloader())  # real batches through the DataLoader + collate
    assert bucketed == pytest.approx(sst2.train_sampler.padding_fraction(0))  # the cheap estimate agrees
    lengths = sst2.splits["train"].lengths
    shuffled = LengthBatchSampler(lengths, 64, bucketing=False, seed=sst2.seed).padding_fraction(0)
    fixed = LengthBatchSampler(lengths, 64, seed=sst2.seed).padding_fraction(0, pad_to=128)
    print(f"\nSST-2 train padding fraction at batch 64: bucketed {bucketed:.1%}, shuffled {shuffled:.1%}, "
          f"fixed max_len=128 {fixed:.1%}")
    assert bucketed <= 0.10
    assert shuffled >= 5 * bucketed and fixed > shuffled


def test_trec_stratified_holdout(tmp_path):
    path = DATA / "trec/train.tsv"
    table = load_table(path, "csv", "\t", 3, ["text", "coarse_label", "fine_label"], str(tmp_path / "hf"))
    _, labels = clean_rows(table["text"], table["coarse_label"], split="train", where=str(path), text_column="text",
                           label_column="coarse_label", label_names=TREC_COARSE, num_classes=6)
    assert len(labels) == 5452
    train, dev = stratified_holdout(labels, 0.1, seed=0)
    assert set(train).isdisjoint(dev) and sorted(train + dev) == list(range(5452))
    total, held = Counter(labels), Counter(labels[i] for i in dev)
    for c, n in total.items():
        assert abs(held[c] - 0.1 * n) <= 1, (TREC_COARSE[c], held[c], n)
    assert stratified_holdout(labels, 0.1, seed=0) == (train, dev)  # deterministic for a seed
    assert stratified_holdout(labels, 0.1, seed=1)[1] != dev

    # the datamodule holds out exactly that split, and trains on the rest
    dm = TextClassificationDataModule(
        "trec", {"train": "trec/train.tsv", "test": "trec/test.tsv"}, label_column="coarse_label",
        label_names=TREC_COARSE, data_dir=str(DATA), delimiter="\t", quoting=3, dev_split=0.1, seed=0,
        tokenizer_kind="bytes", cache_dir=str(tmp_path / "cache"), max_len=64,
    )
    dm.setup()
    assert {s: len(d) for s, d in dm.splits.items()} == {"train": len(train), "validation": len(dev), "test": 500}
    assert Counter(dm.splits["validation"].labels.tolist()) == held


# ---------------------------------------------------------------------- tokenizers and cache


def test_two_runs_that_prepare_one_cache_entry_together_build_it_once(tmp_path, caplog):
    first, second = toy_dm(tmp_path), toy_dm(tmp_path, write=False)
    with caplog.at_level(logging.INFO, logger="mhalab.data.datamodule"):
        together(first.prepare_data, second.prepare_data)
    said = [r.getMessage() for r in caplog.records]
    assert sum(" tokenizer (vocab " in m for m in said) == 1 and sum(": encoded " in m for m in said) == 1, said
    first.setup("fit")
    second.setup("fit")  # both read the one entry
    assert first.splits["train"].ids.tolist() == second.splits["train"].ids.tolist()


def test_tokenizer_cache_keys(tmp_path, monkeypatch):
    dm = toy_dm(tmp_path)
    dm.setup()
    assert dm.tokenizer_path.is_file()
    trained = []
    real_train = datamodule_module.train_tokenizer
    monkeypatch.setattr(datamodule_module, "train_tokenizer", lambda *a, **k: trained.append(1) or real_train(*a, **k))

    same = toy_dm(tmp_path, write=False)  # (rewriting the files would change their mtime: a new key)
    same.setup()
    assert trained == [] and same.tokenizer_path == dm.tokenizer_path
    assert torch.equal(same.splits["train"].ids, dm.splits["train"].ids)

    other = toy_dm(tmp_path, write=False, vocab_size=90)
    assert other.tokenizer_path != dm.tokenizer_path
    other.setup()
    assert trained == [1]

    longer = toy_dm(tmp_path, write=False, max_len=32)  # same tokenizer, new encoding
    assert longer.tokenizer_path == dm.tokenizer_path
    longer.setup()
    assert trained == [1]

    before = dm.tokenizer_path
    train_file = tmp_path / "data/toy/train.tsv"  # the data changed (size, mtime): a new key
    train_file.write_text(train_file.read_text() + "an extra row\t1\n")
    assert toy_dm(tmp_path, write=False).tokenizer_path != before


def test_byte_tokenizer_ids_are_bytes_plus_specials():
    tok = byte_tokenizer()
    assert tok.get_vocab_size() == 260
    assert encode_texts(tok, ["héllo"], 100) == [[CLS_ID, *[4 + b for b in "héllo".encode()], 3]]
    assert encode_texts(tok.to_str(), ["abcdef"], 5) == [[CLS_ID, 4 + 97, 4 + 98, 4 + 99, 3]]  # truncated, JSON in
    assert load_tokenizer(tok.to_str()).to_str() == tok.to_str()


def test_word_tokenizer_keeps_every_symbol_whole(tmp_path):
    from mhalab.data import train_tokenizer

    tok = train_tokenizer(["[MAX 2 9 [MIN 4 7 ] 0 ]", "[SM 5 6 ]"], "word", vocab_size=64, lowercase=False,
                          min_frequency=1)
    assert tok.get_vocab_size() == 4 + 11  # specials + [MAX [MIN [SM ] and the digits 0 2 4 5 6 7 9
    ids = encode_texts(tok, ["[MAX 2 [SM 9 ] 8 ]"], 100)[0]
    assert len(ids) == 2 + 7 and ids[0] == CLS_ID and ids[-1] == 3 and ids[6] == 1  # '8' unseen: [UNK]


def test_wordpiece_vocabulary_is_the_same_in_every_process(tmp_path):
    """tokenizers' WordPiece trainer alone gives a different vocabulary in each process (hash-map order
    breaks ties: 6 of 6 processes differed on these texts); ours gives one (two processes here), so a fresh clone reproduces a run."""
    texts_file = tmp_path / "texts.json"
    rows = (write_toy_sst2(tmp_path) / "sst2" / "train.tsv").read_text().splitlines()[1:]
    texts_file.write_text(json.dumps([r.split("\t")[0] for r in rows]))
    code = ("import json, sys; from mhalab.data import train_tokenizer; "
            "tok = train_tokenizer(json.load(open(sys.argv[1])), 'wordpiece', 200, True, 1); "
            "print(json.dumps(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])))")
    vocabs = [subprocess.run([sys.executable, "-c", code, str(texts_file)], capture_output=True, text=True,
                             check=True).stdout for _ in range(2)]
    assert len(json.loads(vocabs[0])) > 100 and vocabs[1] == vocabs[0]


def test_wordpiece_pieces_are_ordinary_vocabulary_not_special_tokens():
    from mhalab.data import train_tokenizer

    tok = train_tokenizer(["playing played plays", "saying says said", "#1"], "wordpiece", 40, True, 1)
    assert sorted(t.content for t in tok.get_added_tokens_decoder().values()) == sorted(SPECIALS)
    assert "##s" in tok.get_vocab()
    assert tok.encode("pays", add_special_tokens=False).tokens[-1] == "##s"  # an unseen word still splits into pieces
    # text that spells a piece is punctuation plus a word, as in any WordPiece vocabulary, not the piece
    assert tok.encode("##s", add_special_tokens=False).tokens == ["#", "#", "s"]


def test_collate_and_padding_fraction():
    items = [(torch.tensor([2, 7, 8, 3]), 1), (torch.tensor([2, 3]), 0)]
    b = Collate()(items)
    assert b["input_ids"].tolist() == [[2, 7, 8, 3], [2, 3, 0, 0]]
    assert b["padding_mask"].tolist() == [[False] * 4, [False, False, True, True]]
    assert b["labels"].tolist() == [1, 0] and b["lengths"].tolist() == [4, 2]
    assert padding_fraction([b]) == 2 / 8
    assert Collate(pad_to=6, pad_id=1)(items)["input_ids"].tolist() == [[2, 7, 8, 3, 1, 1], [2, 3, 1, 1, 1, 1]]
    assert padding_fraction([Collate(pad_to=6)(items)]) == 6 / 12


def test_an_encoded_split_gives_each_example_and_its_label_and_the_collate_widens_its_int32_ids():
    split = EncodedSplit.from_lists([[2, 7, 8, 3], [2, 3], [2, 5, 3]], [1, 0, 2])
    assert split.ids.dtype == torch.int32 and len(split) == 3
    assert [(ids.tolist(), label) for ids, label in (split[i] for i in (2, 0, 1))] == [
        ([2, 5, 3], 2), ([2, 7, 8, 3], 1), ([2, 3], 0)]
    assert all(type(split[i][1]) is int for i in range(3))
    b = Collate()([split[0], split[1]])
    assert b["input_ids"].dtype == torch.long and b["input_ids"].tolist() == [[2, 7, 8, 3], [2, 3, 0, 0]]


# ---------------------------------------------------------------------- the batch sampler

_rng = random.Random(0)
LENGTHS = [_rng.randint(1, 100) for _ in range(1000)]


def test_sampler_covers_every_index_once_and_is_deterministic():
    s = LengthBatchSampler(LENGTHS, 32, seed=3)
    batches = list(s)
    assert len(batches) == len(s) == 32  # ceil(1000 / 32)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert min(len(b) for b in batches) == 1000 % 32 and all(len(b) <= 32 for b in batches)
    assert list(LengthBatchSampler(LENGTHS, 32, seed=3)) == batches  # same seed and epoch
    assert list(LengthBatchSampler(LENGTHS, 32, seed=4)) != batches
    s.set_epoch(1)
    epoch1 = list(s)
    assert epoch1 != batches and sorted(i for b in epoch1 for i in b) == list(range(1000))
    s.set_epoch(0)
    assert list(s) == batches
    full = LengthBatchSampler(LENGTHS, 32, drop_last=True)
    assert len(full) == 31 and all(len(b) == 32 for b in full)


def test_sampler_bucketing_and_eval_order():
    bucketed = LengthBatchSampler(LENGTHS, 32).padding_fraction()
    shuffled_sampler = LengthBatchSampler(LENGTHS, 32, bucketing=False)
    assert bucketed < 0.05 and shuffled_sampler.padding_fraction() > 0.3
    # shuffled batches are not sorted within a chunk: their lengths are not monotone
    assert any(LENGTHS[b[0]] < LENGTHS[b[1]] for b in shuffled_sampler) and \
        any(LENGTHS[b[0]] > LENGTHS[b[1]] for b in shuffled_sampler)
    order = [i for b in LengthBatchSampler(LENGTHS, 32, shuffle=False) for i in b]
    assert [LENGTHS[i] for i in order] == sorted(LENGTHS, reverse=True)


def test_sampler_shards_across_two_ranks():
    ranks = [LengthBatchSampler(LENGTHS, 32, seed=5, rank=r, world_size=2) for r in range(2)]
    for s in ranks:
        s.set_epoch(2)
    b0, b1 = list(ranks[0]), list(ranks[1])
    assert len(b0) == len(b1) == len(ranks[0]) == 16  # 32 global batches, 16 each
    assert not {i for b in b0 for i in b} & {i for b in b1 for i in b}
    assert b0 + b1 != [] and sorted(map(tuple, b0 + b1)) == sorted(map(tuple, ranks[0].global_batches(2)))
    odd = [LengthBatchSampler(LENGTHS[:990], 30, rank=r, world_size=2) for r in range(2)]  # 33 global batches
    assert len(list(odd[0])) == len(list(odd[1])) == len(odd[0]) == 16  # one left over, dropped for equal counts
    assert LengthBatchSampler(LENGTHS, 32, shuffle=False, shard=False, rank=1, world_size=2).batches() == \
        LengthBatchSampler(LENGTHS, 32, shuffle=False).batches()  # evaluation: every rank sees all


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_sampler_resumes_mid_epoch_exactly(rank, world):
    s = LengthBatchSampler(LENGTHS, 32, seed=7, rank=rank, world_size=world)
    s.set_epoch(2)
    full = s.batches()
    it = iter(s)
    consumed = [next(it) for _ in range(5)]
    state = s.state_dict()
    assert state == {"epoch": 2, "batches_yielded": 5} and consumed == full[:5]

    resumed = LengthBatchSampler(LENGTHS, 32, seed=7, rank=rank, world_size=world)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning calls this at the start of the resumed epoch: resume point kept
    assert list(resumed) == full[5:]
    assert resumed.state_dict() == {"epoch": 2, "batches_yielded": len(full)}
    resumed.set_epoch(3)  # the next epoch is complete again
    assert list(resumed) == s.batches(3) and len(s.batches(3)) == len(full)


def test_datamodule_state_dict_resumes_and_carries_tokenizer(tmp_path):
    dm = toy_dm(tmp_path)
    dm.setup()
    loader = dm.train_dataloader()
    all_batches = [b["input_ids"] for b in loader]
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = dm.state_dict()
    assert state["train_sampler"] == {"epoch": 0, "batches_yielded": 4} and state["label_names"] == ["0", "1"]
    assert load_tokenizer(state["tokenizer"]).to_str() == dm.tokenizer.to_str()

    again = toy_dm(tmp_path, write=False)
    again.setup()
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in again.train_dataloader()]
    assert len(rest) == len(all_batches) - 4 and all(torch.equal(a, b) for a, b in zip(rest, all_batches[4:]))


class _Recorder(L.LightningModule):
    """The smallest classifier: records the batches its training steps see."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb, self.seen = torch.nn.EmbeddingBag(vocab_size, 2, padding_idx=0), []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].sum(1).tolist())
        return torch.nn.functional.cross_entropy(self.emb(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_lightning_resumes_mid_epoch_on_the_next_unseen_batch(tmp_path, num_workers):
    """A run of 20 steps (10 batches an epoch) checkpoints at step 13 (epoch 1, batch 3); resuming
    from it must train on exactly the batches the uninterrupted run saw from step 13 on. With a
    worker, the DataLoader has drawn batches ahead of the trainer: the checkpoint must not count them."""
    def trainer(**kwargs):
        return L.Trainer(max_steps=20, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                         default_root_dir=tmp_path, **kwargs)

    dm = toy_dm(tmp_path, num_workers=num_workers)
    dm.setup()
    full = _Recorder(dm.vocab_size)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    trainer(callbacks=[ckpt]).fit(full, dm)
    assert len(full.seen) == 20 and full.seen[:10] != full.seen[10:]  # Lightning's set_epoch reached the sampler
    path = next((tmp_path / "ckpt").glob("*step=13*.ckpt"))
    state = torch.load(path, weights_only=False)["TextClassificationDataModule"]
    assert state["train_sampler"] == {"epoch": 1, "batches_yielded": 3}

    again = toy_dm(tmp_path, write=False, num_workers=num_workers)
    again.setup()
    resumed = _Recorder(again.vocab_size)
    trainer().fit(resumed, again, ckpt_path=path)
    assert resumed.seen == full.seen[13:]


# ---------------------------------------------------------------------- bad inputs, one-line errors


def test_data_dir_and_files_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("MHALAB_DATA_DIR", raising=False)
    with pytest.raises(DataError, match=r"data directory '.*nowhere' does not exist.*MHALAB_DATA_DIR"):
        toy_dm(tmp_path, data_dir=str(tmp_path / "nowhere")).setup()
    with pytest.raises(DataError, match=r"no data directory for 'toy': set data.data_dir=.*MHALAB_DATA_DIR"):
        toy_dm(tmp_path, data_dir=None).setup()
    with pytest.raises(DataError, match=r"toy validation file '.*toy/dev.tsv' does not exist.*data.data_dir="):
        toy_dm(tmp_path, files={"train": "toy/train.tsv", "validation": "toy/dev.tsv"}).setup()
    monkeypatch.setenv("MHALAB_DATA_DIR", str(tmp_path / "data"))  # the environment variable is a data_dir
    dm = toy_dm(tmp_path, data_dir=None)
    dm.setup()
    assert len(dm.splits["train"]) == 40


def _bad_rows(tmp_path, rows, kind="tsv", **kwargs):
    toy_data(tmp_path, kind)  # valid validation/test files
    write_rows(tmp_path / f"data/toy/train.{kind}", rows, kind)
    return toy_dm(tmp_path, kind, write=False, **kwargs)


@pytest.mark.parametrize("kind,rows,kwargs,error,match", [
    ("tsv", [("ok", 0), ("fine", 1), ("bad", 5)], {}, DataError,
     r"train line 4 of toy file '.*train.tsv': label '5' in column 'label' is not one of the integers 0\.\.1"),
    ("tsv", [("ok", 0), ("bad", "pos")], {}, DataError, r"train line 3 .*label 'pos' .*integers 0\.\.1"),
    ("jsonl", [("ok", 0), ("bad", None)], {}, DataError, r"train line 2 .*label None in column 'label'"),
    ("csv", [("ok", "neg"), ("bad", "NUM")], {"label_names": ["neg", "pos"], "num_classes": None}, DataError,
     r"train line 3 .*label 'NUM' .*not one of \['neg', 'pos'\] \(or indices 0\.\.1\)"),
    ("tsv", [("ok", 0), ("", 1)], {}, DataError,
     r"train line 3 of .*: text column 'text' is empty \(''\); .*on_bad_rows=drop"),
    ("jsonl", [("ok", 0), (None, 1)], {}, DataError, r"train line 2 of .*: text column 'text' is missing"),
    ("tsv", [], {}, DataError, r"train split of toy file '.*train.tsv' has no usable rows \(0 read\)"),
    ("tsv", [("ok", 0)], {"text_column": "sentence"}, DataError,
     r"text_column='sentence' is not a column of toy train file .*; columns present: \['text', 'label'\]"),
    ("parquet", [("ok", 0)], {"label_column": "y"}, DataError,
     r"label_column='y' is not a column .*columns present: \['text', 'label'\]"),
])
def test_bad_rows_raise_before_tokenizer_training(tmp_path, monkeypatch, kind, rows, kwargs, error, match):
    monkeypatch.setattr(datamodule_module, "train_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer"))
    dm = _bad_rows(tmp_path, rows, kind, **kwargs)
    with pytest.raises(error, match=match):
        dm.prepare_data()


def test_on_bad_rows_drop_warns_with_the_count(tmp_path, caplog):
    rows = toy_rows(40, 0)
    rows[3], rows[9] = ("   ", 1), ("", 0)
    dm = _bad_rows(tmp_path, rows, on_bad_rows="drop")
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.splits["train"]) == 38
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropped 2 of 40 train rows with a missing or empty 'text'" in w for w in warnings), warnings


# ---------------------------------------------------------------------- bad files: encoding, gzip, delimiter


def plain_lines(n: int, seed: int = 0) -> list[str]:
    """CSV lines 'words,label' whose texts hold no delimiter or quote (safe for any quoting)."""
    return [f"{t},{label}\n" for t, label in toy_rows(n + len(SPECIAL_TEXTS), seed)[len(SPECIAL_TEXTS):]]


def _latin1_csv(path: Path) -> None:  # line 5 (the header is line 1) holds an é, written as latin-1
    lines = ["text,label\n", *plain_lines(30)]
    lines[4] = "un café noir,1\n"
    path.write_bytes("".join(lines).encode("latin-1"))


def _jsonl_gz_bytes(n: int = 2000) -> bytes:
    return gzip.compress("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in toy_rows(n, 0)).encode())


def _truncated_gz(path: Path) -> None:
    data = _jsonl_gz_bytes()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes_gz(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4000))


def _corrupt_gz(path: Path) -> None:  # a valid gzip header, garbage in the middle: the CRC check fails
    data = bytearray(_jsonl_gz_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = random.Random(1).randbytes(64)
    path.write_bytes(bytes(data))


def _bad_deflate_gz(path: Path) -> None:  # a valid gzip header, a broken first deflate block: zlib.error
    data = bytearray(_jsonl_gz_bytes())
    data[10:18] = b"\xff" * 8
    path.write_bytes(bytes(data))


def _latin1_jsonl_gz(path: Path) -> None:  # pyarrow's JSON reader would keep the bad bytes silently
    lines = [json.dumps({"text": t, "label": label}, ensure_ascii=False) + "\n" for t, label in toy_rows(30, 0)]
    lines[2] = json.dumps({"text": "un café noir", "label": 1}, ensure_ascii=False) + "\n"
    path.write_bytes(gzip.compress("".join(lines).encode("latin-1")))


def _extra_field(line: int):
    def write(path: Path) -> None:
        lines = ["text,label\n", *plain_lines(30)]
        lines[line - 1] = "great, fun,1\n"  # with quoting=3 the comma cannot be quoted: three fields
        path.write_text("".join(lines))
    return write


def _bad_json_line_5(path: Path) -> None:
    lines = [json.dumps({"text": t, "label": label}) + "\n" for t, label in toy_rows(30, 0)]
    lines[4] = '{"text": "broken, "label": 1}\n'
    path.write_text("".join(lines))


def _keep(path: Path) -> None:  # the fixture file as written: the case is in the reading settings
    pass


COMMA_WITH_TSV_SETTINGS = {"delimiter": "\t", "quoting": 3}  # what a csv inherits from sst2.yaml
BAD_FILES = [  # id, fixture kind, train file writer, datamodule arguments, found by validate()?, message parts
    ("latin1-csv", "csv", _latin1_csv, {}, True,
     ["line 5 is not valid utf-8 (byte 0xe9 at column 7)", "set data.encoding=latin-1", "re-save the file as UTF-8"]),
    ("latin1-jsonl.gz", "jsonl.gz", _latin1_jsonl_gz, {}, True,
     ["line 3 is not valid utf-8 (byte 0xe9 at column 17)", "data.encoding=latin-1"]),
    ("truncated-jsonl.gz", "jsonl.gz", _truncated_gz, {}, True,
     ["is not a complete gzip file (truncated or corrupt: Compressed file ended before the end-of-stream marker",
      "re-download or re-compress it"]),
    ("random-bytes-gz", "jsonl.gz", _random_bytes_gz, {}, True,
     ["is not a complete gzip file (truncated or corrupt: Not a gzipped file", "re-download or re-compress it"]),
    ("corrupt-crc-gz", "jsonl.gz", _corrupt_gz, {}, True,
     ["is not a complete gzip file (truncated or corrupt: CRC check failed", "re-download or re-compress it"]),
    ("corrupt-deflate-gz", "jsonl.gz", _bad_deflate_gz, {}, True,
     ["is not a complete gzip file (truncated or corrupt: Error -3 while decompressing data: invalid block type)",
      "re-download or re-compress it"]),
    ("comma-file-tab-settings", "csv", _keep, COMMA_WITH_TSV_SETTINGS, True,
     [("the header 'text,label' has one column with data.delimiter='\\t'; it looks comma-separated: "
       "set data.delimiter=',' and data.quoting=0 (csv.QUOTE_MINIMAL).")]),
    ("tab-file-comma-settings", "tsv", _keep, {"delimiter": ",", "quoting": 0}, True,
     [("the header 'text\\tlabel' has one column with data.delimiter=','; it looks tab-separated: "
       "set data.delimiter='\\t'.")]),
    ("extra-field-line-7", "csv", _extra_field(7), {"quoting": 3}, False,
     ["line 7 has 3 fields but the header has 2 (data.delimiter=',', data.quoting=3 (csv.QUOTE_NONE))",
      "set data.quoting=0 (csv.QUOTE_MINIMAL), or use a data.delimiter the texts lack"]),
    ("extra-field-line-2", "csv", _extra_field(2), {"quoting": 3}, True,  # pandas would shift it silently
     ["line 2 has 3 fields but the header has 2", "data.quoting=0"]),
    ("bad-json-line-5", "jsonl", _bad_json_line_5, {}, False,
     ["line 5 is not valid JSON (Expecting ',' delimiter at column 20)", "check data.format"]),
]


@pytest.mark.parametrize("kind,write,kwargs,in_validate,parts", [c[1:] for c in BAD_FILES],
                         ids=[c[0] for c in BAD_FILES])
def test_bad_files_name_file_line_and_fix_before_tokenizer_training(tmp_path, monkeypatch, kind, write, kwargs,
                                                                    in_validate, parts):
    monkeypatch.setattr(datamodule_module, "train_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer"))
    toy_data(tmp_path, kind)  # valid validation / test files
    if kind == "csv":  # ones valid under quoting=3 too (no quoted commas)
        for split in ("validation", "test"):
            (tmp_path / f"data/toy/{split}.csv").write_text("".join(["text,label\n", *plain_lines(8, 1)]))
    train = tmp_path / f"data/toy/train.{kind}"
    write(train)
    dm = toy_dm(tmp_path, kind, write=False, **kwargs)
    if in_validate:  # the checks before any loading find it
        with pytest.raises(DataError) as found:
            dm.validate()
    with pytest.raises(DataError) as err:
        dm.prepare_data()
    message = str(err.value)
    if in_validate:
        assert str(found.value) == message
    print(f"\n{message}")
    assert message.startswith(f"'{train}'") and "\n" not in message
    for part in parts:
        assert part in message
    assert err.value.__cause__ is not None or in_validate  # load-time errors keep the library's as their cause
    assert list((tmp_path / "cache").rglob("tokenizer-*.json")) == []


@pytest.mark.parametrize("name,format,write,kwargs,part", [
    ("train.csv", "csv", _latin1_csv, {}, "line 5 is not valid utf-8 (byte 0xe9 at column 7); set data.encoding="),
    ("train.jsonl.gz", "json", _truncated_gz, {}, "is not a complete gzip file (truncated or corrupt: Compressed"),
    ("train.jsonl.gz", "json", _corrupt_gz, {}, "is not a complete gzip file (truncated or corrupt: CRC check"),
    ("train.jsonl.gz", "json", _bad_deflate_gz, {}, "is not a complete gzip file (truncated or corrupt: Error -3"),
    ("train.csv", "csv", _extra_field(7), {"quoting": 3}, "line 7 has 3 fields but the header has 2"),
], ids=["latin1-csv", "truncated-gz", "corrupt-crc-gz", "corrupt-deflate-gz", "extra-field"])
def test_load_table_names_the_file_for_what_the_readers_raise(tmp_path, name, format, write, kwargs, part):
    """The readers' own errors (pandas, pyarrow, gzip, wrapped by `datasets`) as DataErrors, for
    files that reach load_table (validate() normally finds the encoding and gzip ones first)."""
    path = tmp_path / name
    write(path)
    with pytest.raises(DataError) as err:
        load_table(path, format, cache_dir=str(tmp_path / "hf"), **kwargs)
    assert str(err.value).startswith(f"'{path}'") and part in str(err.value)
    assert err.value.__cause__ is not None  # `raise ... from`: HYDRA_FULL_ERROR=1 shows the library's error


def test_encoding_latin1_reads_the_latin1_file(tmp_path):
    toy_data(tmp_path, "csv")
    _latin1_csv(tmp_path / "data/toy/train.csv")
    dm = toy_dm(tmp_path, "csv", write=False, encoding="latin-1")
    dm.validate()
    texts, _ = dm.read_splits()["train"]
    assert texts[3] == "un café noir"  # line 5: the header, then rows 0..3
    dm.setup()
    assert len(dm.splits["train"]) == 30
    assert dm.encoding == "iso8859-1"  # the codec's canonical name: latin1, latin-1, iso-8859-1 share a cache
    assert toy_dm(tmp_path, "csv", write=False, encoding="ISO-8859-1").tokenizer_path == dm.tokenizer_path
    assert toy_dm(tmp_path, "csv", write=False, encoding="cp1252").tokenizer_path != dm.tokenizer_path


def test_validate_skips_the_full_read_once_the_cache_is_complete(tmp_path, monkeypatch):
    dm = toy_dm(tmp_path, "jsonl.gz")
    calls = []
    real = datamodule_module.check_stream
    monkeypatch.setattr(datamodule_module, "check_stream", lambda *a: calls.append(a[0].name) or real(*a))
    dm.validate()
    assert sorted(calls) == ["test.jsonl.gz", "train.jsonl.gz", "validation.jsonl.gz"]
    dm.setup()  # builds the cache (validate: files read in full once more, as the cache was not complete)
    calls.clear()
    toy_dm(tmp_path, "jsonl.gz", write=False).validate()
    assert calls == []  # same files (size, mtime) and settings: they were read in full when the cache was built


@pytest.mark.parametrize("kwargs,match", [
    ({"max_len": 0}, r"max_len=0 is too small: it must be >= 3"),
    ({"batch_size": 0}, r"batch_size=0 .* must be >= 1"),
    ({"vocab_size": 3}, r"vocab_size=3 is below the minimum 5 for tokenizer_kind=wordpiece \(4 special tokens"),
    ({"vocab_size": 200, "tokenizer_kind": "bpe"}, r"vocab_size=200 is below the minimum 260 .*256 byte symbols"),
    ({"tokenizer_kind": "sentencepiece"}, r"tokenizer_kind='sentencepiece' is not supported"),
    ({"format": "xml"}, r"format='xml' is not supported"),
    ({"on_bad_rows": "skip"}, r"on_bad_rows='skip' is not supported"),
    ({"num_classes": None}, r"set num_classes .* or label_names"),
    ({"label_names": ["a", "b", "c"]}, r"num_classes=2 but label_names has 3 names"),
    ({"dev_split": 0.1}, r"dev_split=0.1 but files already has a validation split"),
    ({"dev_split": 1.5, "files": {"train": "toy/train.tsv"}}, r"dev_split=1.5 must be a fraction in \(0, 1\)"),
    ({"files": {"train": "toy/train.tsv"}}, r"there is no validation split: add files.validation, or set dev_split"),
    ({"files": {"train": "toy/train.tsv", "dev": "toy/dev.tsv"}}, r"files must map 'train'.*got \['dev', 'train'\]"),
    ({"encoding": "utf9"}, r"encoding='utf9' is not a known text encoding; use e.g. utf-8, latin-1"),
])
def test_bad_arguments_fail_at_construction(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        toy_dm(tmp_path, **kwargs)


def test_asking_for_data_before_setup_says_so(tmp_path):
    dm = toy_dm(tmp_path)
    with pytest.raises(RuntimeError, match=r"call prepare_data\(\) and setup\(\)"):
        dm.train_dataloader()
    with pytest.raises(RuntimeError, match=r"the tokenizer exists after prepare_data\(\) and setup\(\)"):
        _ = dm.vocab_size


def test_a_split_encoded_in_chunks_holds_the_same_ids_as_encoded_whole():
    from mhalab.data.collate import EncodedSplit

    ids = [[2, 5, 6, 3], [2, 3], [2, 7, 8, 9, 10, 3], [2, 11, 3]]
    whole = EncodedSplit.from_lists(ids, [0, 1, 0, 1])
    chunked = EncodedSplit.from_chunks([ids[:1], [], ids[1:3], ids[3:]], [0, 1, 0, 1])  # an empty chunk too
    for a, b in ((whole.ids, chunked.ids), (whole.offsets, chunked.offsets), (whole.labels, chunked.labels)):
        assert torch.equal(a, b)
    assert chunked.ids.dtype == torch.int32 and [chunked[i][0].tolist() for i in range(4)] == ids
    assert whole.lengths == chunked.lengths == [4, 2, 6, 3]
