"""ListOps generator (LRA's spec) and its datamodule: determinism, labels checked by an independent
evaluator, lengths, class coverage, the generated files, and `data=listops` end to end."""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import together

from mhalab.data.listops import (
    GENERATOR_VERSION,
    ListOpsDataModule,
    generate_examples,
    generate_listops,
    generator_settings,
    sample_tree,
)

OPS = {"[MAX", "[MIN", "[MED", "[SM"}
VOCAB = OPS | {"]"} | {str(d) for d in range(10)}


# ------------------------------------------------------------------ an evaluator written from the spec

def evaluate(text: str) -> int:
    """Value of a ListOps expression, by a stack machine over its tokens (not the generator's code)."""
    stack: list = []
    for tok in text.split():
        if tok in OPS:
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            assert len(args) >= 1, text
            if op == "[MAX":
                v = max(args)
            elif op == "[MIN":
                v = min(args)
            elif op == "[MED":
                v = int(statistics.median(args))  # LRA: int(np.median(...))
            else:
                v = sum(args) % 10
            if stack:
                stack[-1].append(v)
            else:
                stack.append(v)
        else:
            d = int(tok)
            assert 0 <= d <= 9
            if stack and isinstance(stack[-1], list):
                stack[-1].append(d)
            else:
                stack.append(d)
    assert len(stack) == 1 and isinstance(stack[0], int), f"unbalanced expression: {text}"
    return stack[0]


def structure(text: str) -> tuple[int, list[int]]:
    """(max nesting depth counting the root as 1, argument counts of every operator)."""
    depth = best = 0
    counts: list[list[int]] = []
    done: list[int] = []
    for tok in text.split():
        if tok in OPS:
            if counts:
                counts[-1][0] += 1
            depth += 1
            best = max(best, depth)
            counts.append([0])
        elif tok == "]":
            done.append(counts.pop()[0])
            depth -= 1
        elif counts:
            counts[-1][0] += 1
    return best, done


@pytest.mark.parametrize("text, value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[SM 5 6 [MED 1 2 9 ] ]", 3),
    ("[MED 1 2 ]", 1),            # even count: mean of the middle two, rounded down
    ("[MED 3 4 6 9 ]", 5),
    ("[MIN [MAX 1 8 ] [SM 9 9 9 ] 7 ]", 7),
    ("4", 4),
])
def test_evaluator_on_hand_written_expressions(text, value):
    assert evaluate(text) == value


# ------------------------------------------------------------------ the generator

def test_generator_is_deterministic_for_a_seed():
    a = generate_examples(150, seed=3, min_length=10, max_length=120)
    b = generate_examples(150, seed=3, min_length=10, max_length=120)
    c = generate_examples(150, seed=4, min_length=10, max_length=120)
    assert a == b
    assert a != c


def test_labels_equal_the_evaluated_value_on_many_samples():
    examples = generate_examples(2000, seed=0, min_length=1, max_length=300)
    bad = [(t, v) for t, v in examples if evaluate(t) != v]
    assert not bad, f"{len(bad)} wrong labels, e.g. {bad[0]}"
    assert any(t.count("[MED") for t, _ in examples)


def test_lengths_depth_arity_and_tokens_follow_the_spec():
    examples = generate_examples(400, seed=1, min_length=40, max_length=200, max_depth=6, max_args=5)
    lengths = [len(t.split()) for t, _ in examples]
    assert min(lengths) >= 40 and max(lengths) <= 200
    assert len({t for t, _ in examples}) == len(examples)  # distinct, as LRA's set()
    for text, _ in examples:
        toks = text.split()
        assert set(toks) <= VOCAB
        assert toks[0] in OPS and toks[-1] == "]"  # a tree, not a bare digit
        depth, arities = structure(text)
        assert depth <= 6 and all(2 <= a <= 5 for a in arities)
    # the lengths spread over the range, not piled at one end
    assert max(lengths) - min(lengths) > 60 and len(set(lengths)) > 40


def test_lra_spec_lengths_and_all_classes_present():
    lra = generate_examples(25, seed=0, min_length=501, max_length=1999)
    assert all(501 <= len(t.split()) <= 1999 for t, _ in lra)
    assert all(evaluate(t) == v for t, v in lra)
    cpu = generate_examples(1000, seed=0, min_length=128, max_length=510)
    counts = Counter(v for _, v in cpu)
    assert set(counts) == set(range(10)), counts
    assert max(counts.values()) < 0.35 * len(cpu), counts  # roughly balanced (LRA's 0 and 9 lead)


def test_sample_tree_respects_the_length_budget():
    import random

    rng = random.Random(0)
    for _ in range(300):
        tree = sample_tree(rng, max_length=30)
        assert tree is None or len(tree[0]) <= 30


def test_bad_generator_settings_raise():
    with pytest.raises(ValueError, match="min_length"):
        generate_examples(5, min_length=50, max_length=10)
    with pytest.raises(ValueError, match="max_args"):
        generate_examples(5, max_args=1)
    with pytest.raises(RuntimeError, match="widen the length range"):
        generate_examples(5, min_length=2000, max_length=2000, max_depth=2, max_tries=200)


def test_generated_files_are_written_once_and_keyed_by_settings(tmp_path):
    kw = {"num_train": 60, "num_validation": 20, "num_test": 20, "min_length": 10, "max_length": 80, "max_depth": 10, "max_args": 10,
              "seed": 0}
    out = generate_listops(tmp_path, **kw)
    assert out.parent == tmp_path and out.name.startswith("generated-")
    rows = {}
    for split, n in (("train", 60), ("validation", 20), ("test", 20)):
        lines = (out / f"{split}.tsv").read_text().splitlines()
        assert lines[0] == "Source\tTarget" and len(lines) == n + 1
        rows[split] = [line.split("\t") for line in lines[1:]]
        assert all(evaluate(t) == int(v) for t, v in rows[split])
    # the three splits are disjoint
    texts = [t for r in rows.values() for t, _ in r]
    assert len(set(texts)) == len(texts)
    assert not list(out.glob(".*.tmp"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert generate_listops(tmp_path, **kw) == out  # present: not regenerated
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    other = generate_listops(tmp_path, **dict(kw, seed=1))
    assert other != out
    assert generator_settings(**kw)["version"] == GENERATOR_VERSION


def test_two_runs_that_need_the_same_trees_together_generate_them_once(tmp_path, caplog):
    kw = {"num_train": 300, "num_validation": 50, "num_test": 50, "min_length": 10, "max_length": 80, "seed": 0}
    outs = []
    with caplog.at_level(logging.INFO, logger="mhalab.data.listops"):
        together(*[lambda: outs.append(generate_listops(tmp_path, **kw))] * 2)
    assert len(outs) == 2 and outs[0] == outs[1]
    assert sum("listops: generated" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------ the datamodule

def small_dm(tmp_path: Path, **kw) -> ListOpsDataModule:
    args = {"num_train": 120, "num_validation": 30, "num_test": 30, "min_length": 10, "max_length": 100, "max_len": 102,
                "cache_dir": str(tmp_path), "batch_size": 16}
    return ListOpsDataModule(**(args | kw))


def test_datamodule_reads_the_generated_files_word_level(tmp_path):
    dm = small_dm(tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    vocab = dm.tokenizer.get_vocab()
    assert set(vocab) == VOCAB | {"[PAD]", "[UNK]", "[CLS]", "[SEP]"} and dm.vocab_size == 19
    assert vocab["[PAD]"] == dm.pad_id == 0
    gen_dir = Path(dm.data_dir)
    rows = [line.split("\t") for line in (gen_dir / "train.tsv").read_text().splitlines()[1:]]
    split = dm.splits["train"]
    assert len(split) == 120
    for i in range(5):  # one id per token, wrapped in [CLS] ... [SEP], label = the file's
        ids, label = split[i]
        assert [dm.tokenizer.id_to_token(int(t)) for t in ids] == ["[CLS]", *rows[i][0].split(), "[SEP]"]
        assert label == int(rows[i][1])
    assert {s: len(d) for s, d in dm.splits.items()} == {"train": 120, "validation": 30, "test": 30}
    assert max(max(d.lengths) for d in dm.splits.values()) <= 102  # nothing truncated
    batch = next(iter(dm.train_dataloader()))
    assert 1 <= batch["input_ids"].shape[0] <= 16 and batch["labels"].max() <= 9
    # the labels are the evaluated values of the decoded ids
    ids, pad, labels = batch["input_ids"], batch["padding_mask"], batch["labels"]
    for j in range(4):
        toks = [dm.tokenizer.id_to_token(int(t)) for t in ids[j][~pad[j]]]
        assert toks[0] == "[CLS]" and toks[-1] == "[SEP]"
        assert evaluate(" ".join(toks[1:-1])) == int(labels[j])


def test_datamodule_refuses_truncation_and_subsets(tmp_path):
    with pytest.raises(ValueError, match="truncating a ListOps sequence"):
        small_dm(tmp_path, max_len=64)
    dm = small_dm(tmp_path, max_examples={"train": 40})
    dm.prepare_data()
    dm.setup("fit")
    assert abs(len(dm.splits["train"]) - 40) <= 10 and len(dm.splits["test"]) == 30


def test_hydra_config_data_listops_builds_and_runs_the_model(tmp_path):
    from conftest import compose_train

    from mhalab.train.run import build

    cfg = compose_train(["data=listops", "max_len=66", "data.max_length=64", "data.min_length=8",
                         "data.num_train=64", "data.num_validation=16", "data.num_test=16", "batch_size=8"],
                        tmp_path / "out", cache=tmp_path / "cache", small_vocab=False)
    assert cfg.data.tokenizer_kind == "word" and cfg.model.max_len == 66
    dm, module = build(cfg)
    assert dm.num_classes == 10 and module.hparams.vocab_size == 19
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        logits = module(batch["input_ids"], batch["padding_mask"])
    assert logits.shape == (8, 10)
