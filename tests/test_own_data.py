"""data=files: a user's own csv / tsv / jsonl(.gz) / parquet files with nothing configured but their paths.

The reference for what a file holds is Python's csv / json modules and pyarrow reading it back; the dev
split is checked against stratified_holdout's rule (round(0.1 * n) of each class), the label sets against
the rule written out by hand (0..K-1 -> "0".."K-1", other integers numerically, strings sorted).
"""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_train

from mhalab.data import OwnFilesDataModule, own_files
from mhalab.data.inference import choose_columns, infer_labels, sniff_delimiter
from mhalab.errors import ConfigError, DataError
from mhalab.train.config import instantiate

WORDS = {"sports": ["goal", "match", "team", "league", "coach"], "politics": ["vote", "senate", "law", "party"],
         "tech": ["chip", "code", "robot", "cloud", "app"]}
TOPICS = sorted(WORDS)  # ['politics', 'sports', 'tech']: class i is the i-th sorted name
SMALL = {"vocab_size": 200, "min_frequency": 1, "max_len": 32, "batch_size": 8}


def news_rows(n_per_class: int = 30, seed: int = 0, labels=TOPICS) -> list[tuple[str, str]]:
    """(text, label) rows whose texts hold commas and a double quote, so csv must quote them."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_per_class * len(labels)):
        label = labels[i % len(labels)]
        topic = WORDS.get(label, WORDS[TOPICS[i % 3]])
        rows.append((f"{' '.join(rng.choices(topic, k=3))}, the {rng.choice(['day', 'week'])} said \"{i}\"", label))
    return rows


def write(path: Path, rows, kind: str = "csv", columns=("id", "text", "category"), delimiter: str = ",") -> Path:
    """Rows (text, label) as a file of `kind`, with an id column first; numbers stay numbers in json/parquet."""
    records = [dict(zip(columns, (i, *row))) for i, row in enumerate(rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind in ("csv", "tsv"):
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t" if kind == "tsv" else delimiter,
                                quoting=csv.QUOTE_NONE if kind == "tsv" else csv.QUOTE_MINIMAL, escapechar=None)
            writer.writerow(columns)
            writer.writerows([r[c] for c in columns] for r in records)
    elif kind == "csv.gz":
        path.write_bytes(gzip.compress(write(path.with_suffix(""), rows, "csv", columns).read_bytes()))
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def ambiguous_csv(path: Path) -> Path:
    """Two long-text columns and a label column of no known name: nothing is obvious."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("title", "body", "tag")] + [(f"headline number {i} of the day", t, y)
                                                              for i, (t, y) in enumerate(news_rows(10))])
    return path


def dm_for(tmp_path: Path, **kwargs) -> OwnFilesDataModule:
    return OwnFilesDataModule(**{"cache_dir": str(tmp_path / "cache"), **SMALL, **kwargs})


def rows_of(dm: OwnFilesDataModule) -> dict[str, list[tuple[str, str]]]:
    """Each split's (text, label name), after validate(): what the datamodule read and checked."""
    dm.validate()
    return {s: [(t, dm.label_names[y]) for t, y in zip(*pair)] for s, pair in dm.read_splits().items()}


def all_rows(dm: OwnFilesDataModule) -> list[tuple[str, str]]:
    return sorted(itertools.chain(*rows_of(dm).values()))


def test_csv_with_string_labels_infers_columns_sorted_names_and_a_stratified_dev_split(tmp_path, monkeypatch):
    rows = news_rows(30)
    write(tmp_path / "news.csv", rows)
    monkeypatch.chdir(tmp_path)  # the path as typed, relative to the current directory
    dm = dm_for(tmp_path, files={"train": "news.csv"})
    got = rows_of(dm)
    assert (dm.name, dm.text_column, dm.label_column, dm.delimiter) == ("news", "text", "category", ",")
    assert dm.label_names == ["politics", "sports", "tech"] and dm.num_classes == 3 and dm.dev_split == 0.1
    with open(tmp_path / "news.csv", newline="") as f:  # the reference reader
        expected = [(r["text"], r["category"]) for r in csv.DictReader(f)]
    assert expected == rows and any("," in t and '"' in t for t, _ in expected)
    assert sorted(got["train"] + got["validation"]) == sorted(expected)  # every row, quoted commas kept
    assert sorted(label for _, label in got["validation"]) == sorted(TOPICS * 3)  # round(0.1 * 30) per class


@pytest.mark.parametrize("kind", ["tsv", "csv.gz", "jsonl.gz", "parquet"])
def test_tsv_jsonl_gz_and_parquet_give_the_csvs_rows(tmp_path, kind):
    rows = news_rows(10, labels=TOPICS)
    rows = [(t.replace('"', ""), y) for t, y in rows] if kind == "tsv" else rows  # tsv: no quoting
    csv_dm = dm_for(tmp_path, files={"train": str(write(tmp_path / "a" / "news.csv", rows))})
    other = dm_for(tmp_path, files={"train": str(write(tmp_path / "b" / f"news.{kind}", rows, kind))})
    assert rows_of(other) == rows_of(csv_dm)
    assert (other.format, other.text_column, other.label_column) == (
        {"tsv": "csv", "csv.gz": "csv", "jsonl.gz": "json", "parquet": "parquet"}[kind], "text", "category")
    if kind == "tsv":
        assert other.delimiter == "\t" and other.quoting == csv.QUOTE_NONE


@pytest.mark.parametrize("delimiter", [",", "\t", ";", "|"])
def test_sniff_delimiter_finds_each_delimiter_with_texts_holding_the_others(tmp_path, delimiter):
    path = tmp_path / "x.csv"
    others = "".join(d for d in ",\t;|" if d != delimiter)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(["text", "label"])
        w.writerows([f"a{others[i % 3]}b c {i}", i % 2] for i in range(20))
    assert sniff_delimiter(path) == delimiter


def test_semicolon_csv_is_sniffed_and_an_explicit_delimiter_is_kept(tmp_path, monkeypatch):
    rows = [(t.replace('"', ""), y) for t, y in news_rows(5)]  # unquoted commas in a ;-separated file
    semi = write(tmp_path / "semi.csv", rows, delimiter=";")
    assert "," in semi.read_text().splitlines()[1] and '"' not in semi.read_text()
    dm = dm_for(tmp_path, files={"train": str(semi)})
    assert all_rows(dm) == sorted(rows) and dm.delimiter == ";"

    monkeypatch.setattr(own_files, "sniff_delimiter", lambda *a: pytest.fail("sniffed despite data.delimiter"))
    pipe = write(tmp_path / "pipe.csv", rows, delimiter="|")
    dm = dm_for(tmp_path, files={"train": str(pipe)}, delimiter="|")
    assert all_rows(dm) == sorted(rows) and dm.delimiter == "|"


@pytest.mark.parametrize("columns, text, label", [
    (["id", "text", "label"], "text", "label"),
    (["review", "stars"], "review", "stars"),  # a text name; the label is the one column left
    (["headline", "Category"], "headline", "Category"),  # a label name; the text is the one column left
    (["id", "body", "y"], "body", "y"),  # the one long-text column (id is numeric)
])
def test_columns_are_chosen_by_name_or_shape(columns, text, label):
    rows = [{c: (str(i) if c in ("id", "stars") else "sports" if c in ("label", "y", "Category")
                 else "a long enough text about things") for c in columns} for i in range(5)]
    assert choose_columns("f", columns, rows, None, None) == (text, label)
    assert choose_columns("f", columns, rows, columns[-1], columns[0]) == (columns[-1], columns[0])  # explicit wins


def test_ambiguous_columns_are_one_line_listing_them_and_naming_the_keys(tmp_path):
    path = ambiguous_csv(tmp_path / "news.csv")
    with pytest.raises(DataError) as e:
        dm_for(tmp_path, files={"train": str(path)}).validate()
    assert str(e.value) == (f"news train file '{path}': cannot tell which column holds the text and label; its "
                            f"columns are ['title', 'body', 'tag']: set data.text_column=<column> and "
                            f"data.label_column=<column>.")
    dm = dm_for(tmp_path, files={"train": str(path)}, text_column="body", label_column="tag")
    assert rows_of(dm) and dm.label_names == TOPICS  # the keys it names are the fix


def test_a_bad_row_is_named_by_its_line_in_the_file_even_after_a_quoted_line_break(tmp_path):
    """The audit's case: an empty text on line 6 (the 5th data row) was reported as "row 4"; a quoted cell that spans
    two lines moves every later line by one."""
    train = tmp_path / "q.csv"
    train.write_text('text,label\na good film,1\na bad film,0\n"a long\nfilm",1\nok,0\n,1\nnice,1\n')
    with pytest.raises(DataError, match=r"^train line 7 of q file '.*q.csv': text column 'text' is empty"):
        rows_of(dm_for(tmp_path, files={"train": str(train)}))
    train.write_text("text,label\na good film,1\na bad film,0\nfine,1\nok,0\n,1\nnice,1\n")
    with pytest.raises(DataError, match=r"^train line 6 of q file"):
        rows_of(dm_for(tmp_path, files={"train": str(train)}))


def test_a_test_label_train_never_saw_is_an_error_naming_it_the_split_and_file(tmp_path):
    train = write(tmp_path / "train.csv", news_rows(10))
    test = write(tmp_path / "test.csv", news_rows(2) + [("rain all week, the day said", "weather")])
    dm = dm_for(tmp_path, files={"train": str(train), "test": str(test)})
    with pytest.raises(DataError) as e:
        rows_of(dm)
    assert str(e.value) == (f"test line 8 of {tmp_path.name} file '{test}': label 'weather' in column 'category' is "
                            f"not one of the train split's labels {TOPICS}; fix the file, or add train rows with that "
                            f"label (the label set is train's).")


@pytest.mark.parametrize("kind, labels, names", [
    ("csv", [0, 1, 2], ["0", "1", "2"]),
    ("csv", [1, 2, 3, 4, 5, 10], ["1", "2", "3", "4", "5", "10"]),  # numeric order: "10" last, not second
    ("parquet", [-1, 1], ["-1", "1"]),  # ints in the file: matched as the names str() writes
])
def test_integer_labels_are_0_to_k_names_or_sorted_numerically(tmp_path, caplog, kind, labels, names):
    rows = [(f"text number {i} about something", labels[i % len(labels)]) for i in range(10 * len(labels))]
    dm = dm_for(tmp_path, files={"train": str(write(tmp_path / f"nums.{kind}", rows, kind))})
    with caplog.at_level("INFO", logger="mhalab.data.own_files"):
        got = rows_of(dm)
    assert dm.label_names == names and dm.num_classes == len(names)
    assert ("read as names in numeric order" in caplog.text) == (labels != list(range(len(labels))))  # said so
    assert sorted(itertools.chain(*got.values())) == sorted((t, str(y)) for t, y in rows)  # each row kept its own value
    assert infer_labels(["b", " a ", None, "b"], "f", "y").names == ["a", "b"]  # missing: left to the row check


def test_source_config_rebuilds_the_same_cache_and_dev_split_from_another_directory(tmp_path, monkeypatch):
    import mhalab.data.datamodule as datamodule_module

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write(tmp_path / "a" / "data" / "news" / "train.csv", news_rows(20))
    monkeypatch.chdir(tmp_path / "a")
    dm = dm_for(tmp_path, files={"train": "data/news/train.csv"})
    dm.prepare_data()
    dm.setup("fit")
    assert dm.name == "news"  # train.csv is named for its folder
    config = dm.source_config()
    assert config["files"] == {"train": str(tmp_path / "a" / "data" / "news" / "train.csv")}
    assert {k: config[k] for k in ("format", "delimiter", "text_column", "label_column", "label_names",
                                   "num_classes", "dev_split")} == {
        "format": "csv", "delimiter": ",", "text_column": "text", "label_column": "category", "label_names": TOPICS,
        "num_classes": 3, "dev_split": 0.1}
    monkeypatch.chdir(tmp_path / "b")
    monkeypatch.setattr(datamodule_module, "train_tokenizer", lambda *a, **k: pytest.fail("rebuilt the cache"))
    again = instantiate(json.loads(json.dumps(config)))  # what a checkpoint stores: plain JSON
    again.setup("fit")
    assert again._cache_paths() == dm._cache_paths() and again.label_names == TOPICS
    for split in ("train", "validation"):
        assert torch.equal(again.splits[split].labels, dm.splits[split].labels)
        assert again.splits[split].lengths == dm.splits[split].lengths
    assert again.read_splits()["validation"] == dm.read_splits()["validation"]  # what mhalab-eval reads


def test_data_dir_is_the_folder_relative_paths_are_read_from(tmp_path, monkeypatch):
    write(tmp_path / "corpora" / "news.csv", news_rows(10))
    monkeypatch.chdir(tmp_path)
    dm = dm_for(tmp_path, files={"train": "news.csv"}, data_dir="corpora")
    dm.validate()
    assert dm.files == {"train": str(tmp_path / "corpora" / "news.csv")} and dm.source_config()["data_dir"] is None


def test_a_second_run_reads_the_inferred_labels_from_the_cache_not_the_file(tmp_path, monkeypatch):
    path = write(tmp_path / "news.csv", news_rows(5))
    first = dm_for(tmp_path, files={"train": str(path)})
    first.validate()
    monkeypatch.setattr(own_files, "load_table", lambda *a, **k: pytest.fail("read the train file again"))
    second = dm_for(tmp_path, files={"train": str(path)})
    second.validate()
    assert second.label_names == first.label_names == TOPICS and second._cache_paths() == first._cache_paths()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"files": {"train": None}}, ConfigError, r"^data=files needs a train file: data.files.train=<path>"),
    ({"files": {"train": "x.xlsx"}}, ConfigError, r"^data.files.train='x.xlsx': the format cannot be told"),
    ({"files": {"train": "a.csv", "test": "b.jsonl"}}, ConfigError, r"^data.files are of different formats"),
    ({"files": {"train": "a.csv", "validation": "b.csv"}, "dev_split": 0.2}, ConfigError, r"set one or the other"),
    ({"files": {"train": "no-such.csv"}}, DataError, r"^data.files.train='no-such.csv' does not exist \(looked for"),
])
def test_bad_own_files_settings_are_one_line(tmp_path, monkeypatch, kwargs, error, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        dm_for(tmp_path, **kwargs).validate()


def test_data_files_run_trains_3_classes_with_sorted_names_and_evaluates_from_another_dir(tmp_path, monkeypatch):
    from mhalab.train import checkpoint
    from mhalab.train.commands.evaluate import evaluate
    from mhalab.train.run import run

    write(tmp_path / "news.csv", news_rows(30))
    write(tmp_path / "test.csv", news_rows(4, seed=1))
    monkeypatch.chdir(tmp_path)
    cfg = compose_train(["data=files", "data.files.train=news.csv", "data.files.test=test.csv",
                         "+trainer.max_steps=3", "max_epochs=1", "num_threads=1"], tmp_path / "run",
                        cache=tmp_path / "cache")
    run(cfg)
    loaded = checkpoint.load_model(tmp_path / "run")
    assert loaded.label_names == TOPICS and loaded.module.hparams["num_classes"] == 3
    assert loaded.module.model(torch.tensor([[2, 5, 3]])).shape == (1, 3)
    rec = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert rec["status"] == "finished" and 0.0 <= rec["best"]["test/acc"] <= 1.0 and rec["label_names"] == TOPICS
    assert rec["data"]["files"]["train"] == str(tmp_path / "news.csv")  # the source_config(), absolute
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # mhalab-eval from another directory: the same dev hold-out
    res = evaluate(tmp_path / "run", split="validation")
    assert res["examples"] == 9 and res["classes"]["support"] == [3, 3, 3]


def test_a_run_with_only_a_train_file_finishes_with_validation_results_and_no_test(tmp_path, monkeypatch):
    from mhalab.train.run import run

    write(tmp_path / "news.csv", news_rows(30))
    monkeypatch.chdir(tmp_path)
    cfg = compose_train(["data=files", "data.files.train=news.csv", "+trainer.max_steps=2", "max_epochs=1",
                         "num_threads=1", "extras.print_config=false"], tmp_path / "run", cache=tmp_path / "cache")
    run(cfg)
    rec = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert rec["status"] == "finished" and "val/acc" in rec["best"]
    assert not any(k.startswith("test/") for k in rec["best"]) and "test" not in rec["classes"]
    assert sum(rec["classes"]["validation"]["support"]) == 9  # the held-out 10% of 90 rows


def test_the_command_line_prints_an_ambiguous_file_as_one_error_line(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "tests"))
    from cli_driver import run_one

    ambiguous_csv(tmp_path / "news.csv")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_one sets argv
    res = run_one(["mhalab-train", "data=files", "data.files.train=news.csv", f"hydra.run.dir={tmp_path / 'run'}",
                   f"paths.cache_dir={tmp_path / 'cache'}"])
    lines = [line for line in res["stderr"].splitlines() if line.strip()]
    assert res["returncode"] == 2 and "Traceback" not in res["stderr"], res["stderr"][-2000:]
    assert lines[-1] == (f"error: news train file '{tmp_path / 'news.csv'}': cannot tell which column holds the "
                         f"text and label; its columns are ['title', 'body', 'tag']: set data.text_column=<column> "
                         f"and data.label_column=<column>.")
    assert sum(line.startswith("error:") for line in lines) == 1
