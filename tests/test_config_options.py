"""Every option of every config group composes, builds its model and trains one batch on its own data.

The cases come from the files: each conf/<group>/<option>.yaml (and conf/hydra/<group>/<option>.yaml), so a
new option is covered by being added. Per case:
  compose the real conf/train.yaml with `<group>=<option>` (a sweep or a search: one real member, the first
  value of each swept parameter), mhalab.train.config.validate, mhalab.train.build (the datamodule reads, tokenizes
  and sets up its data; the Classifier is made), then one forward and backward pass on the training batch that
  holds the longest training example (the batch a too-small position table fails on), and the Lightning
  parts the option configures (Trainer, loggers, callbacks).
Data: the data group and the sweep / experiment presets run on the real files in ../shared/data (the data
set they pick: SST-2 for the presets, ListOps or byte-level IMDB for sweep=lra*), composed as a user types
them (no size overrides: compose_train's dim/max_len/batch_size shortcuts would replace the option's own);
the other groups run on the toy SST-2 through compose_train. hydra/<group> options only compose (launching
is tests/test_train.py's and the sweep tests' job). The checkout's .cache holds the tokenizers and ids, as for
`make train`: each real data set is tokenized once, for this file, tests/test_doc_commands.py and the user's runs.
Cost caps (what the option configures stays, see CAPS and _rows): ListOps generates fewer trees of the same
lengths, byte-level IMDB keeps a stratified subset (its own data.max_examples), and big models / long batches train on
a few rows of the batch, its longest row included, so the width stays the batch's.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import CONF, REPO, SHARED_DATA, compose_train
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from lightning.pytorch.callbacks import Callback, ProgressBar
from omegaconf import OmegaConf, open_dict

from mhalab.train import pretrain
from mhalab.train.config import instantiate, validate
from mhalab.train.loggers import prepare_wandb
from mhalab.train.run import build

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
HYDRA_GROUPS = sorted(f"hydra/{p.name}" for p in (CONF / "hydra").iterdir() if p.is_dir())
REAL_DATA = ("data", "sweep", "experiment")  # groups whose options pick (or are) a data set: run on shared/data
MULTIRUN = ("sweep", "hparams_search")  # groups whose options are a set of runs: compose their first member
# what compose_train sets for the toy runs (those keys of an option are replaced there on purpose)
TOY_KEYS = {"paths", "trainer.accelerator", "trainer.precision", "trainer.enable_progress_bar",
            "trainer.log_every_n_steps", "callbacks.progress_bar", "dim", "heads", "layers", "batch_size", "max_len",
            "data.vocab_size", "data.min_frequency"}

# Per data set (data.name): settings replaced for speed. None of them is read by the training batch's model.
CAPS = {
    # the generator's lengths (and so the widths) stay the option's; fewer trees (listops_lra: 96k -> 1.2k).
    # Above sweep=lra's max_examples, so its stratified subset still applies.
    "listops": {"num_train": 1200, "num_validation": 250, "num_test": 450},
    # byte-level IMDB: a stratified subset (the option's own data.max_examples) unless the option sets one
    "imdb_bytes": {"max_examples": {"train": 256, "validation": 64, "test": 64}},
}
ONE_THREAD = True  # conftest.one_thread: on a busy 2-core machine one intra-op thread is faster
# The rows of a batch one case trains on (see _rows): about 1 s of CPU per case. Attention's (L, L) products run
# about 10x slower per FLOP than the dense layers on CPU (memory-bound softmax, masks, dropout).
STEP_BUDGET = 7e10
ATTENTION_COST = 10


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# make test-slow: sweep=lra_gpu (20 s, the LRA kinds at the paper's width; sweep=lra runs in CI) and data=imdb
# (32 s, tokenizing 50k reviews; the README's `mhalab-train data=imdb` trains on it in CI)
SLOW_OPTIONS = {"sweep=lra_gpu", "data=imdb"}
CASES = [pytest.param(g, o, id=f"{g}={o}", marks=[pytest.mark.slow] if f"{g}={o}" in SLOW_OPTIONS else [])
         for g in GROUPS + HYDRA_GROUPS for o in _options(g)]


def _first(spec) -> str:
    """The first value of a swept parameter: `64,128` -> 64; `choice(2, 4)` -> 2; `tag(log, interval(1e-4, 3e-3))`
    -> 1e-4."""
    s = str(spec)
    if "(" in s:
        s = s.rsplit("(", 1)[1]
    return s.split(",")[0].strip(" )")


def _hydra_compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def _compose_as_typed(overrides: list[str], out: Path, cache: Path):
    """conf/train.yaml with the overrides and only the paths set: every size is the option's own."""
    base = [f"paths.output_dir={out}", f"paths.data_dir={SHARED_DATA}", f"paths.cache_dir={cache}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=base + overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def _cap(cfg) -> dict:
    caps = {}
    for key, value in CAPS.get(cfg.data.name, {}).items():
        if key == "max_examples" and cfg.data.get("max_examples") is not None:
            continue  # the option chose its own subset
        current = OmegaConf.select(cfg, f"data.{key}")
        if isinstance(value, int) and isinstance(current, int):
            value = min(value, current)
        with open_dict(cfg):
            OmegaConf.update(cfg, f"data.{key}", value, merge=False)
        caps[key] = value
    return caps


def _same(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def _leaves(node, prefix: str = ""):
    for k, v in node.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _dig(node, key: str):
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<missing>"
        node = node[part]
    return node


def _assert_holds_the_option(cfg, group: str, option: str, skip: set[str]) -> int:
    """Every value the option's file sets (interpolations unresolved) is in the composed config, except the
    keys in `skip` (set on purpose by this test: the toy sizes, the sweep member, the caps). Returns how many
    were compared."""
    path = CONF / group / f"{option}.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    glob = re.search(r"^#\s*@package\s+_global_\s*$", path.read_text(), re.MULTILINE) is not None
    root = OmegaConf.to_container(cfg if glob else cfg[group], resolve=False)
    n = 0
    for key, value in _leaves({k: v for k, v in raw.items() if k not in ("defaults", "hydra")}):
        full = key if glob else f"{group}.{key}"
        if any(full == s or full.startswith(f"{s}.") for s in skip):
            continue
        got = _dig(root, key)
        assert got == value or (not isinstance(value, (dict, list)) and _same(got, value)), (full, got, value)
        n += 1
    return n


def _rows(batch: dict, cfg) -> torch.Tensor:
    """Rows of the batch to train on, longest first: all of them within STEP_BUDGET, else the longest and
    evenly spaced others down to the shortest (the longest alone for the longest sequences), so the width
    (the batch's longest example) is always the batch's."""
    B, L = batch["input_ids"].shape
    m = cfg.model
    dense = 3 * m.layers * L * (4 * m.dim**2 + 2 * m.dim * m.ff_dim)  # projections and feed-forward, fwd + bwd
    scores = 3 * m.layers * 4 * L * L * m.dim  # the (L, L) attention products
    k = max(1, min(B, int(STEP_BUDGET // (dense + ATTENTION_COST * scores))))
    order = torch.argsort(batch["lengths"], descending=True, stable=True)
    return order if k >= B else order[torch.linspace(0, B - 1, k).round().long()]


def _longest_train_batch(dm) -> tuple[dict, int]:
    """The training batch (as dm.train_dataloader() deals them) that holds the longest training example."""
    loader = dm.train_dataloader()
    lengths = torch.tensor(loader.batch_sampler.lengths)
    idx = max(loader.batch_sampler, key=lambda b: int(lengths[b].max()))
    return loader.collate_fn([loader.dataset[i] for i in idx]), int(lengths.max())


def _trainer_kwargs(cfg) -> dict:
    """cfg.trainer as train.py passes it; without a GPU, GPU options fall back to CPU (construct only)."""
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kwargs.get("accelerator") == "gpu" and not torch.cuda.is_available():
        kwargs.update(accelerator="cpu", precision="32-true", devices=1, strategy="auto")
    if kwargs.get("accelerator") == "cpu" and kwargs.get("devices") == -1:
        kwargs["devices"] = 2
    if kwargs.get("strategy") == "ddp":
        kwargs["strategy"] = "ddp_spawn"  # construct only; nothing is launched
    return kwargs


@pytest.fixture(scope="module")
def cache() -> Path:
    # the checkout's own cache, as `make train` uses it: data=imdb's tokenizer and ids (~50 s to build) are
    # built once for this file, tests/test_doc_commands.py's `python train.py data=imdb` and the user's own runs
    return REPO / ".cache"


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """wandb sees no key, netrc or settings file of this machine, and writes under tmp_path."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_DIR",
                "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.setenv(var, "")  # setenv first: monkeypatch restores it afterwards even if it was unset
        monkeypatch.delenv(var)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def _compose_case(group: str, option: str, out: Path, toy_data_dir: Path, cache: Path):
    """(config, the sweep member's overrides as {key: value}, whether it runs on shared/data, the caps)."""
    overrides = [f"{group}={option}"]
    member = {}
    if group in MULTIRUN:  # a real member: the first value of each swept parameter
        hcfg = _hydra_compose(overrides)
        assert hcfg.hydra.mode == RunMode.MULTIRUN, hcfg.hydra.mode
        member = {k: _first(v) for k, v in (hcfg.hydra.sweeper.params or {}).items()}
        overrides += [f"{k}={v}" for k, v in member.items()]
    if (group, option) == ("data", "files"):  # the user's own files: here TREC's, by their paths
        member = {"data.data_dir": str(SHARED_DATA), "data.files.train": "trec/train.tsv",
                  "data.files.test": "trec/test.tsv", "data.label_column": "coarse_label"}
        overrides += [f"{k}={v}" for k, v in member.items()]
    real = group in REAL_DATA or any(o.startswith("data=") for o in overrides)
    if real or group == "trainer":  # as typed: compose_train would set the sizes (and the trainer to CPU)
        cfg = _compose_as_typed(overrides, out, cache)
        if not real:
            with open_dict(cfg):
                cfg.paths.data_dir = str(toy_data_dir)
                cfg.data.vocab_size, cfg.data.min_frequency = 200, 1  # the toy data has ~30 words
    else:
        cfg = compose_train(overrides, out, toy_data_dir, cache)
    if member:  # the member is what was composed: group choices (data=listops) and values (dim=64)
        choices = _hydra_compose(overrides).hydra.runtime.choices
        for key, value in member.items():
            got = choices[key] if (CONF / key).is_dir() else OmegaConf.select(cfg, key)
            assert _same(got, value), (key, got, value)
    caps = _cap(cfg) if real else {}
    toy = set() if real or group == "trainer" else TOY_KEYS
    n = _assert_holds_the_option(cfg, group, option, toy | set(member) | {f"data.{k}" for k in caps})
    return cfg, real, dict(caps, values_checked=n)


def _check_model(cfg, dm, module, real: bool) -> None:
    """The model is the option's, for the data set's vocabulary and classes, read from the real files."""
    model = module.model
    if real and cfg.data.name != "listops":  # (ListOps is generated under cache_dir)
        data_dir = Path(cfg.data.data_dir)
        assert data_dir == SHARED_DATA and all((data_dir / f).exists() for f in dm.files.values() if f)
    encoder = model.encoder.layers if hasattr(model.encoder, "layers") else model.encoder.encoder.layers
    assert model.embed.embedding_dim == cfg.model.dim and len(encoder) == cfg.model.layers
    assert {lyr.self_attn.num_heads for lyr in encoder} == {cfg.model.heads}
    # (num_classes null: found from the train file, as data=files does; TREC's 6 coarse classes here)
    assert model.head.out_features == dm.num_classes == (cfg.data.get("num_classes") or dm.num_classes)
    assert model.embed.num_embeddings == dm.vocab_size


def _train_one_batch(cfg, dm, module) -> str:
    """Forward and backward on the longest training batch: fits the position table, a finite positive loss,
    (rows, classes) logits, finite gradients on every trainable parameter, non-zero on (nearly) all."""
    model = module.model
    batch, longest = _longest_train_batch(dm)
    B, width = batch["input_ids"].shape
    cls = int(cfg.model.pooling == "cls")
    capacity = model.pos.max_len if model.pos is not None else cfg.model.max_len + cls
    assert 1 <= B <= cfg.data.batch_size and width == longest
    assert longest <= cfg.data.max_len <= cfg.model.max_len, (longest, cfg.data.max_len, cfg.model.max_len)
    assert longest + cls <= capacity, f"batch width {longest} (+{cls} CLS) > the position table's {capacity}"
    assert batch["labels"].min() >= 0 and batch["labels"].max() < dm.num_classes

    rows = _rows(batch, cfg)
    sub = {k: v[rows] for k, v in batch.items() if torch.is_tensor(v)}
    assert sub["input_ids"].shape[1] == width and int(sub["lengths"].max()) == longest
    module.train()
    t0 = time.perf_counter()
    logits = module(sub["input_ids"], sub["padding_mask"])
    assert logits.shape == (len(rows), dm.num_classes)
    loss = F.cross_entropy(logits, sub["labels"])
    assert torch.isfinite(loss) and loss.item() > 0, loss
    loss.backward()
    step_s = time.perf_counter() - t0
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    no_grad = [n for n, p in params.items() if p.grad is None]
    bad = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    zero = [n for n, p in params.items() if p.grad is not None and not p.grad.any()]
    assert params and not no_grad and not bad, (no_grad, bad)
    assert len(zero) <= 0.1 * len(params), zero
    return (f"batch {B}x{width} ({len(rows)} rows trained), step {step_s:.1f}s, loss {loss.item():.3f}, "
            f"{len(zero)}/{len(params)} zero grads")


def _lightning_parts(cfg, root: Path) -> None:
    """Loggers (wandb through prepare_wandb: offline here), every callback, and the Trainer, as train.py
    makes them (GPU options on CPU where there is none)."""
    loggers = []
    for name, lcfg in OmegaConf.to_container(cfg.get("logger") or {}, resolve=True).items():
        if lcfg is None:
            continue
        if name == "wandb":
            lcfg = prepare_wandb(lcfg, None, multirun=False)
            assert lcfg["offline"] is True and lcfg["log_model"] is False
        lg = instantiate(lcfg)
        assert name in type(lg).__name__.lower(), (name, type(lg))
        if name == "wandb":
            assert lg._offline is True
        loggers.append(lg)
    assert loggers or not cfg.get("logger")
    entries = [c for c in (cfg.get("callbacks") or {}).values() if c is not None]
    callbacks = [instantiate(c) for c in entries]
    assert all(isinstance(c, Callback) for c in callbacks)
    assert [type(c).__name__ for c in callbacks] == [c._target_.rsplit(".", 1)[1] for c in entries]
    assert {type(c).__name__ for c in callbacks} >= {"ModelCheckpoint", "LearningRateMonitor"}
    kwargs = _trainer_kwargs(cfg)
    if not kwargs.get("enable_progress_bar", True):  # as train.py: Lightning refuses a bar callback then
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    trainer = L.Trainer(**kwargs, logger=loggers or False, callbacks=callbacks, default_root_dir=str(root))
    if isinstance(kwargs.get("devices"), int) and kwargs["devices"] > 0:
        assert trainer.num_devices == kwargs["devices"]


@pytest.mark.parametrize("group,option", CASES)
def test_option_composes_builds_and_trains_one_batch(group, option, tmp_path, toy_data_dir, cache,
                                                    no_wandb_account):
    if group.startswith("hydra/"):  # composes into the hydra config only; launching is another test's job
        node = OmegaConf.select(_hydra_compose([f"{group}={option}"]), group.replace("/", "."))
        assert node._target_.startswith("hydra_plugins."), node._target_
        raw = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"), resolve=False)
        composed = OmegaConf.to_container(node, resolve=False)
        for key, value in raw.items():
            if key != "defaults":
                assert composed.get(key, "<missing>") == value, (key, composed.get(key, "<missing>"), value)
        return

    cfg, real, caps = _compose_case(group, option, tmp_path / "out", toy_data_dir, cache)
    validate(cfg)
    t0 = time.perf_counter()
    dm, module = build(cfg, pretrain.stage(cfg))  # the pretrained start, when the option asks for one
    build_s = time.perf_counter() - t0
    _check_model(cfg, dm, module, real)
    step = _train_one_batch(cfg, dm, module)
    _lightning_parts(cfg, tmp_path)
    print(f"{group}={option}: build {build_s:.1f}s, {step}, caps {caps or '-'}")
