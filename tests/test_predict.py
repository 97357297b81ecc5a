"""mhalab-predict and the one checkpoint loader: from nothing but a checkpoint, the predicted probabilities
are the model's own softmax, in input order (the batches are length-sorted), with the label names; txt,
csv, tsv, jsonl and stdin inputs; users' mistakes are one line naming the value and the fix."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF, compose_train, write_toy_sst2
from hydra import compose, initialize_config_dir

from mhalab.errors import ConfigError, DataError
from mhalab.train import checkpoint
from mhalab.train.commands.predict import command, predict, read_texts
from mhalab.train.run import run

NAMES = ["neg", "pos"]
# different lengths, not in length order: the batches (of 3, length-sorted) mix them up
TEXTS = ["a good film", "the plot was awful and the actor was dull and boring", "great", "it is weak",
         "a lovely and moving story of a film", "bad", "the movie is fine and the story is superb", "clumsy plot"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run dir (1 epoch on toy data whose labels are the names neg / pos)."""
    tmp = tmp_path_factory.mktemp("predict")
    data = write_toy_sst2(tmp / "data")
    for f in (data / "sst2").glob("*.tsv"):
        lines = f.read_text().splitlines()
        f.write_text("\n".join([lines[0]] + [s.rsplit("\t", 1)[0] + "\t" + NAMES[int(s[-1])] for s in lines[1:]]) + "\n")
    cfg = compose_train(["max_epochs=1", "test_after_fit=false", "data.num_classes=null",
                         f"data.label_names=[{','.join(NAMES)}]"], tmp / "run", data, tmp / "cache")
    run(cfg)
    return tmp / "run"


def _predict_cfg(**overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("predict", overrides=[f"{k}={v}" for k, v in overrides.items()])


def test_loader_gives_the_model_in_eval_mode_with_tokenizer_names_and_data_config(trained):
    loaded = checkpoint.load_model(trained)  # a run dir: the best checkpoint its metrics.json reports
    best = json.loads((trained / "metrics.json").read_text())["best"]["checkpoint"]
    assert loaded.path == trained / "checkpoints" / Path(best).name and loaded.path.name.startswith("epoch00-acc")
    assert checkpoint.load_model(trained, which="last").path == trained / "checkpoints" / "last.ckpt"
    assert not loaded.module.training and not loaded.module.model.training
    assert loaded.label_names == NAMES and loaded.max_len == 32 and loaded.data["name"] == "sst2"
    assert loaded.tokenizer.encode("a good film").tokens == ["[CLS]", "a", "good", "film", "[SEP]"]
    saved = torch.load(loaded.path, map_location="cpu", weights_only=True)
    for key, value in saved["state_dict"].items():  # the weights are the checkpoint's
        assert torch.equal(loaded.module.state_dict()[key], value), key


def test_checkpoint_carries_the_extras_the_module_was_given(trained):
    loaded = checkpoint.load_model(trained)
    extras = loaded.module.checkpoint_extras
    assert extras["datamodule_key"] == "TextClassificationDataModule" and extras["data"]["label_names"] == NAMES
    extras["data"] = "changed"  # a copy: the module's own cannot be replaced from outside
    assert loaded.module.checkpoint_extras["data"]["label_names"] == NAMES
    loaded.module.remember(wandb_id="abc123")
    ckpt = {}
    loaded.module.on_save_checkpoint(ckpt)
    assert ckpt["mhalab"]["wandb_id"] == "abc123" and ckpt["mhalab"]["datamodule_key"] == extras["datamodule_key"]
    assert ckpt["mhalab"]["token_counts"][0] > 0  # the counters still travel beside them


def test_probabilities_are_the_models_own_softmax_in_input_order(trained):
    loaded = checkpoint.load_model(trained)
    seen = []  # the real lengths of each batch the model is given
    hook = loaded.module.model.register_forward_pre_hook(lambda m, args: seen.append((~args[1]).sum(1).tolist()))
    try:
        rows = predict(loaded, TEXTS, batch_size=3)
    finally:
        hook.remove()
    lengths = [n for batch in seen for n in batch]
    in_input_order = [len(loaded.tokenizer.encode(t).ids) for t in TEXTS]
    assert len(seen) == 3 and lengths == sorted(in_input_order) and lengths != in_input_order
    assert [r["text"] for r in rows] == TEXTS
    for text, row in zip(TEXTS, rows):
        ids = torch.tensor([loaded.tokenizer.encode(text).ids])  # alone: no padding at all
        with torch.no_grad():
            want = loaded.module(ids).softmax(-1)[0]
        assert list(row["probs"]) == NAMES
        torch.testing.assert_close(torch.tensor(list(row["probs"].values())), want, atol=1e-6, rtol=0)
        assert row["label"] == NAMES[int(want.argmax())]


def test_txt_csv_tsv_jsonl_and_stdin_give_the_same_lines(trained, tmp_path, capsys, monkeypatch):
    files = {"in.txt": "\n".join(TEXTS[:4]) + "\n",
             "in.csv": "id,review\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(TEXTS[:4])),
             "in.tsv": "text\tstars\n" + "".join(f"{t}\t{i}\n" for i, t in enumerate(TEXTS[:4])),
             "in.jsonl": "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS[:4]))}
    outputs = []
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        extra = {"text_column": "review"} if name == "in.csv" else {}
        command(_predict_cfg(ckpt_path=trained, input=tmp_path / name, output=tmp_path / f"{name}.jsonl", **extra))
        outputs.append((tmp_path / f"{name}.jsonl").read_text())
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(TEXTS[:4]) + "\n"))
    command(_predict_cfg(ckpt_path=trained, input="-", progress="false"))
    outputs.append(capsys.readouterr().out)  # output=null: stdout, nothing else on it
    assert all(o == outputs[0] for o in outputs), outputs
    lines = [json.loads(line) for line in outputs[0].splitlines()]
    assert [x["text"] for x in lines] == TEXTS[:4] and all(x["label"] in NAMES for x in lines)


# the case: 4 lines, one blank (and one of spaces); before, 3 rows came out and no message
BLANKS = ["a good film", "", "bad", "   "]


@pytest.mark.parametrize("name, content, column", [
    ("in.txt", "\n".join(BLANKS) + "\n", None),
    ("in.csv", "id,review\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(BLANKS)), "review"),
    ("one.csv", "text\n" + "\n".join(BLANKS) + "\n", None),  # one column: an empty text is a blank row
    ("in.tsv", "text\tstars\n" + "".join(f"{t}\t{i}\n" for i, t in enumerate(BLANKS)), None),
    ("in.jsonl", '{"text": "a good film"}\n{"text": ""}\n{"text": "bad"}\n{"text": null}\n', None),
])
def test_predict_writes_a_row_for_every_input_line_and_counts_the_empty_ones(trained, tmp_path, fork_server, name,
                                                                              content, column):
    """One output row per input line, in order: an empty text's row says so and has no label; stderr counts them."""
    (tmp_path / name).write_text(content)
    res = fork_server.run([str(Path(sys.executable).parent / "mhalab-predict"), f"ckpt_path={trained}",
                           f"input={tmp_path / name}", *([f"text_column={column}"] if column else [])],
                          env=dict(os.environ, PYTHONHASHSEED="0"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 4 and [r["label"] is None for r in rows] == [False, True, False, True]
    assert [r["text"] for r in rows[::2]] == ["a good film", "bad"] and rows[0]["label"] in NAMES
    assert rows[1] == {"text": rows[1]["text"], "label": None, "probs": None, "note": "empty text: no prediction"}
    said = [line for line in res.stderr.splitlines() if "hold no text" in line]
    assert said == [('2 of 4 input lines hold no text (blank, or an empty field): their rows have label null and the '
                    'note "empty text: no prediction"')], res.stderr


def test_quotes_are_text_in_tsv_and_quoting_in_csv(tmp_path):
    (tmp_path / "a.tsv").write_text('text\n"great" acting, "dull" plot\n')
    (tmp_path / "a.csv").write_text('text,stars\n"great acting, dull plot",3\n')
    assert read_texts(str(tmp_path / "a.tsv")) == ['"great" acting, "dull" plot']
    assert read_texts(str(tmp_path / "a.csv")) == ["great acting, dull plot"]


def test_command_line_reads_stdin_and_writes_only_json_lines(trained):
    code = "from mhalab.cli import predict; predict()"
    res = subprocess.run([sys.executable, "-c", code, f"ckpt_path={trained}", "input=-"], input="a good film\nbad\n",
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [x["text"] for x in lines] == ["a good film", "bad"] and set(lines[0]["probs"]) == set(NAMES)
    assert "predicting" not in res.stdout + res.stderr  # not a terminal, output on stdout: no bar


FIX = "pass a .txt file (one text per line), a .csv / .tsv / .jsonl file (a 'text' column), or input=- (stdin)."


@pytest.mark.parametrize("name, content, column, message", [
    ("nosuch.txt", None, None, f"input={{d}}/nosuch.txt does not exist; {FIX}"),
    ("empty.txt", "\n  \n", None, f"input={{d}}/empty.txt holds no texts; {FIX}"),
    ("texts.xlsx", "x", None, f"input={{d}}/texts.xlsx: unknown format '.xlsx'; {FIX}"),
    ("reviews.csv", "review,stars\nfine,4\n", None,
     ("input={d}/reviews.csv has no column 'text' (its columns: review, stars); pass text_column=<the column "
      "with the texts>.")),
    ("reviews.jsonl", '{"text": "ok"}\n{"body": "fine"}\n', None,
     ("input={d}/reviews.jsonl: line 2 has no field 'text' (it has: body); pass text_column=<the field with "
      "the texts>.")),
    ("broken.jsonl", '{"text": "ok"\n', "text",
     "input={d}/broken.jsonl: line 1 is not JSON (Expecting ',' delimiter); write one JSON object per line."),
])
def test_bad_input_is_one_line_naming_the_value_and_the_fix(tmp_path, name, content, column, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError) as e:
        read_texts(str(tmp_path / name), column)
    assert str(e.value) == message.format(d=tmp_path)


def test_missing_ckpt_path_and_bad_batch_size_are_config_errors(trained, tmp_path):
    (tmp_path / "t.txt").write_text("fine\n")
    with pytest.raises(ConfigError, match=r"^ckpt_path is required: mhalab-predict ckpt_path="):
        command(_predict_cfg(input=tmp_path / "t.txt"))
    with pytest.raises(ConfigError, match=r"^batch_size=0 must be a positive integer, e.g. 64.$"):
        command(_predict_cfg(ckpt_path=trained, input=tmp_path / "t.txt", batch_size=0))
