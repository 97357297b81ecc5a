"""Attention maps of one text from a training checkpoint: the library call and its command line.

    mhalab-attention-map ckpt_path=outputs/<run> text="a fine film" [out=<file.png>] [max_len=N] [device=cpu] [dpi=110]

The PNG goes into the run dir it reads (<run>/attention_map.png; a .ckpt outside a run dir: beside it) unless
out= names another file; the command prints its full path.

key=value like every command; parsed here rather than by Hydra because `text` is free text (commas,
brackets and quotes would need Hydra's quoting). Exit 2 for a user error, 3 for a model that has no
explicit weights (linformer, performer).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from mhalab.analysis.attention_maps.plot import plot_attention_maps
from mhalab.analysis.attention_maps.tokens import encode_text
from mhalab.analysis.attention_maps.weights import NoAttentionWeights, attention_weights, check_has_weights
from mhalab.errors import ConfigError, UserError

USAGE = ('usage: mhalab-attention-map ckpt_path=PATH text="..." [out=<run dir>/attention_map.png] [max_len=N] '
         '[device=cpu] [dpi=110] [checkpoint=best|last]')
HELP = ("mhalab-attention-map: every layer's and head's attention weights over one text, drawn from a trained run's "
        "checkpoint as one PNG (a grid of layers x heads, tokens on both axes), with the model's prediction in its "
        "title. Most useful: ckpt_path=<run dir or .ckpt> and text=\"...\" (required), out=<file.png> (default: "
        "attention_map.png in the run dir it reads), checkpoint=best|last (of a run dir), max_len=N (truncate as in "
        "training otherwise). Linformer and Performer attention have no weights to draw (exit 3).")
FILE = "attention_map.png"  # its name in the run dir, when out= names no other file
DEFAULTS = {"out": None, "max_len": None, "device": "cpu", "dpi": "110", "checkpoint": "best"}
KEYS = ("ckpt_path", "text", *DEFAULTS)


def draw_text(loaded, text: str, out: str | Path, max_len: int | None = None, dpi: int = 110) -> dict:
    """Maps of one text into `out`, from a checkpoint.load_model() result; returns {out, tokens, layers,
    heads, prediction}. The text is truncated as in training (or to `max_len` ids)."""
    module = loaded.module
    check_has_weights(module)
    ids, labels = encode_text(module, loaded.tokenizer, text, max_len or loaded.max_len)
    logits, weights = attention_weights(module, ids.to(next(module.parameters()).device))  # (1, C), (1, H, L, L)
    pred = int(logits.argmax(-1)[0])
    hp = dict(module.hparams.get("model", {}))
    title = (f"attention={hp.get('attention', '?')} pos={hp.get('pos', '?')}: prediction {loaded.label(pred)} "
             f"(p={float(logits.softmax(-1)[0, pred]):.2f}), {len(labels)} positions")
    plot_attention_maps([w[0] for w in weights], labels, out, title, dpi=dpi)
    return {"out": str(out), "tokens": labels, "layers": len(weights), "heads": weights[0].size(1),
            "prediction": loaded.label(pred)}


def parse(argv: Sequence[str]) -> dict:
    args = dict(DEFAULTS)
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or key not in KEYS:
            raise ConfigError(f"unknown argument '{a}'; {USAGE}")
        args[key] = value
    missing = [k for k in ("ckpt_path", "text") if k not in args]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required; {USAGE}")
    for key in ("max_len", "dpi"):
        if args[key] is not None and not str(args[key]).isdigit():
            raise ConfigError(f"{key}={args[key]!r} must be a positive integer.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from mhalab.train.checkpoint import describe, load_model, run_dir_of

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(f"{HELP}\n\n{USAGE}")
        return 0
    try:
        args = parse(argv)
        loaded = load_model(args["ckpt_path"], args["device"], args["checkpoint"])
        out = Path(args["out"]) if args["out"] else run_dir_of(loaded.path) / FILE  # beside the run it reads
        res = draw_text(loaded, args["text"], out.resolve(), int(args["max_len"]) if args["max_len"] else None,
                        int(args["dpi"]))
    except NoAttentionWeights as e:
        print(f"attention_map: {e}", file=sys.stderr)
        return 3
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"checkpoint: {describe(loaded.path, loaded.step)}")
    print(f"{res['layers']} layers x {res['heads']} heads over {len(res['tokens'])} positions; "
          f"prediction {res['prediction']}; wrote {res['out']}")
    return 0
