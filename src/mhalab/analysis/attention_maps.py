"""Attention maps: every layer's per-head weights for a text, drawn as a layers x heads grid.

    python scripts/attention_map.py ckpt_path=outputs/.../checkpoints/last.ckpt text="a fine film" out=map.png

`attention_weights(model, input_ids)` runs ONE ordinary forward pass of the classifier (on the padded
layout: the encoder's unpadding is switched off for it) with forward hooks on each layer's self-attention: a pre-hook switches the call to `need_weights=True` (and, for
PyTorch's nn.MultiheadAttention, `average_attn_weights=False`), a post-hook keeps the returned
(B, H, L_q, L_k) weights. So the maps are the weights the model really applies in that pass, layer
inputs included (no re-implementation of the layer). Attention kinds with explicit weights: full and
window (with any position scheme). Linformer and Performer never form a (query, key) weight matrix
(Linformer attends over k learned projections of the keys, Performer over random features), so they
raise `NoAttentionWeights` saying so.

`AttentionMapLogger` is an opt-in Lightning callback (`python train.py callbacks=attention_maps`):
at the end of each validation epoch it draws the maps of the first validation examples and logs the
figure to TensorBoard / Weights & Biases loggers, and saves it under <run dir>/attention_maps/.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn

from mhalab.errors import CheckpointError, UserError

log = logging.getLogger(__name__)

NO_WEIGHTS = {
    "LinformerAttention": "Linformer attends over k learned projections of the keys along the sequence "
                          "(softmax over k rows, not over tokens)",
    "PerformerAttention": "Performer (FAVOR+) estimates softmax attention with random features and never "
                          "forms the (query, key) score matrix",
}


class NoAttentionWeights(ValueError):
    """The model's attention kind has no explicit per-(query, key) weights to draw."""


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model)  # a Classifier (LightningModule) holds the SequenceClassifier


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each encoder layer's self-attention, in order: our MultiHeadAttention or nn.MultiheadAttention."""
    enc = _inner(model).encoder
    layers = enc.layers if hasattr(enc, "layers") else enc.encoder.layers  # custom | OfficialEncoder
    return [layer.self_attn for layer in layers]


def _kernel_name(attn: nn.Module) -> str:
    return type(getattr(attn, "attention", None)).__name__


def check_has_weights(model: nn.Module) -> None:
    """Raise NoAttentionWeights, naming the kind and why, for Linformer / Performer models."""
    for attn in attention_modules(model):
        why = NO_WEIGHTS.get(_kernel_name(attn))
        if why:
            kind = _kernel_name(attn).replace("Attention", "").lower()
            raise NoAttentionWeights(
                f"model.attention={kind} has no explicit attention weights to draw: {why}. Attention maps exist "
                f"for attention=full and attention=window (with any pos)."
            )


@torch.no_grad()
def _no_grad_forward(model, input_ids, padding_mask):
    return model(input_ids, padding_mask)


def attention_weights(model: nn.Module, input_ids: Tensor, padding_mask: Tensor | None = None
                      ) -> tuple[Tensor, list[Tensor]]:
    """(logits (B, C), [per layer (B, H, L, L) weights]) from one forward pass in eval mode.

    With pooling=cls, L counts the model's own CLS vector at position 0 (L = 1 + tokens).
    """
    check_has_weights(model)
    attns = attention_modules(model)
    captured: list[Tensor | None] = [None] * len(attns)

    def pre_hook(module, args, kwargs):
        kwargs = dict(kwargs, need_weights=True)
        if isinstance(module, nn.MultiheadAttention):
            kwargs["average_attn_weights"] = False  # per head, not their mean
        return args, kwargs

    def post_hook(i):
        def hook(module, args, kwargs, output):
            captured[i] = output[1]
        return hook

    was_training = model.training
    model.eval()  # no dropout on the weights
    official = any(isinstance(a, nn.MultiheadAttention) for a in attns)
    encoder = _inner(model).encoder
    with ExitStack() as stack:
        if getattr(encoder, "unpad", False):
            # our encoder runs a padded batch on its packed real tokens ("unpadding"), so self_attn is
            # called with (N, E) tokens; the hooks here read the padded (B, L, E) call, and the padded
            # path gives the same weights
            encoder.unpad = False
            stack.callback(setattr, encoder, "unpad", True)
        for i, attn in enumerate(attns):
            stack.callback(attn.register_forward_pre_hook(pre_hook, with_kwargs=True).remove)
            stack.callback(attn.register_forward_hook(post_hook(i), with_kwargs=True).remove)
        if official:
            # nn.TransformerEncoderLayer skips self_attn (its fused "fast path") when no gradient is
            # needed; with grad enabled it calls self_attn, so the hooks see every layer.
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            input_ids = input_ids.clone()
            padding_mask = None if padding_mask is None else padding_mask.clone()
            logits = model(input_ids, padding_mask).detach()
        else:
            logits = _no_grad_forward(model, input_ids, padding_mask)
    model.train(was_training)
    missing = [i for i, w in enumerate(captured) if w is None]
    if missing:
        raise NoAttentionWeights(f"layers {missing} returned no attention weights (kernel "
                                 f"{_kernel_name(attns[missing[0]])}); maps need attention=full or window.")
    return logits, [w.detach().float() for w in captured]


# ---------------------------------------------------------------------------------------------- tokens

def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """A short readable label per id: the token, or for byte-level vocabularies the byte it stands for."""
    from tokenizers import decoders

    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    labels = []
    for i in ids:
        tok = tokenizer.id_to_token(int(i))
        if tok is None:
            labels.append(f"<{int(i)}>")
        elif tok.startswith("[") and tok.endswith("]") and len(tok) > 2:  # specials: [CLS], [SEP], [PAD]
            labels.append(tok)
        elif byte_level:
            text = tokenizer.decode([int(i)], skip_special_tokens=False)
            labels.append({" ": "␣", "\n": "⏎", "\t": "⇥"}.get(text, text if text.isprintable() else f"0x{int(i) - 4:02x}"))
        else:
            labels.append(tok)
    return [lab if len(lab) <= 12 else lab[:11] + "…" for lab in labels]


def encode_text(module: nn.Module, tokenizer, text: str, max_len: int | None = None) -> tuple[Tensor, list[str]]:
    """(input_ids (1, L), labels of the model's positions) for one text, truncated as training did."""
    from mhalab.data.tokenizer import encode_texts

    inner = _inner(module)
    max_len = max_len or _model_max_len(module)
    ids = encode_texts(tokenizer, [text], max_len)[0]
    labels = token_labels(tokenizer, ids)
    if getattr(inner, "cls", None) is not None:  # pooling=cls: the model prepends its own vector
        labels = ["<cls>"] + labels
    return torch.tensor([ids], dtype=torch.long), labels


def _model_max_len(module: nn.Module) -> int:
    max_len = _inner_hparams(module).get("max_len")
    if max_len is None:
        raise ValueError("cannot tell the model's max_len (no hparams.model.max_len); pass max_len=...")
    return int(max_len)


# ------------------------------------------------------------------------------------------------ plot

def plot_attention_maps(weights: Sequence[Tensor], labels: Sequence[str], path: str | Path | None = None,
                        title: str = "", max_label_ticks: int = 40, dpi: int = 110):
    """Grid of layers (rows) x heads (columns), each a (query, key) heatmap of one example.

    weights: per layer (H, L, L) (or (1, H, L, L)); labels: L token labels. Each panel has its own color
    scale (0 to its max weight), printed in its title. Returns the matplotlib Figure (saved to `path`).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    mats = [w[0] if w.dim() == 4 else w for w in weights]
    n_layers, n_heads, L = len(mats), mats[0].size(0), mats[0].size(-1)
    if len(labels) != L:
        raise ValueError(f"{len(labels)} labels for {L} positions.")
    cell = min(6.0, max(2.6, 0.16 * L))
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads + 0.6, cell * n_layers + 0.8),
                             squeeze=False)
    step = max(1, -(-L // max_label_ticks))
    ticks = list(range(0, L, step))
    fs = max(4, min(8, int(220 / max(len(ticks), 1))))
    for li, mat in enumerate(mats):
        for h in range(n_heads):
            ax = axes[li][h]
            w = mat[h].cpu().numpy()
            vmax = float(w.max()) or 1.0
            ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
            ax.set_title(f"layer {li} head {h} (max {vmax:.2g})", fontsize=8)
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.set_xticklabels([labels[t] for t in ticks], rotation=90, fontsize=fs)
            ax.set_yticklabels([labels[t] for t in ticks], fontsize=fs)
            if li == n_layers - 1:
                ax.set_xlabel("key", fontsize=8)
            if h == 0:
                ax.set_ylabel("query", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path, dpi)
    return fig


def save_png(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a figure as a 256-colour palette PNG: heatmaps have few distinct colours to begin with,
    and the file is several times smaller than matplotlib's RGBA PNG."""
    import io

    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256).save(path, optimize=True)
    return path


# ---------------------------------------------------------------------------------------- checkpoint

def checkpoint_tokenizer(ckpt: dict) -> tuple[str | None, list[str] | None]:
    """(tokenizer JSON, label names) from a train.py checkpoint: in the datamodule's state, which Lightning
    saves under the datamodule's class name (checkpoint["mhalab"]["datamodule_key"]), or directly in
    checkpoint["mhalab"] (older checkpoints); else in any saved state that holds a tokenizer."""
    extra = ckpt.get("mhalab") or {}
    places = [extra, ckpt.get(extra.get("datamodule_key"), {})]
    places += [v for v in ckpt.values() if isinstance(v, dict) and "tokenizer" in v]
    for place in places:
        if isinstance(place, dict) and place.get("tokenizer"):
            names = place.get("label_names") or extra.get("label_names")
            return place["tokenizer"], list(names) if names else None
    return None, None


def load_checkpoint(ckpt_path: str | Path, device: str = "cpu"):
    """(Classifier in eval mode, tokenizer) from a training checkpoint (a .ckpt, or a run dir: its last.ckpt).

    The model comes from `Classifier.load_from_checkpoint`, the tokenizer from the checkpoint itself
    (see `checkpoint_tokenizer`); the label names end up in `module.extra_checkpoint["label_names"]`.
    """
    from mhalab.data.tokenizer import load_tokenizer
    from mhalab.train import checkpoint
    from mhalab.train.module import Classifier

    path = checkpoint.resolve(ckpt_path)  # the one resolver: a .ckpt, a run dir, or `last`
    tokenizer, names = checkpoint_tokenizer(checkpoint.load(path))  # weights_only: it cannot run code
    if not tokenizer:
        raise CheckpointError(f"{path} carries no tokenizer (neither the datamodule's state nor checkpoint['mhalab']); "
                         f"it was not written by train.py, so the text cannot be turned into the model's ids.")
    module = Classifier.load_from_checkpoint(path, map_location=device, compile=False, weights_only=True)
    module.extra_checkpoint = dict(getattr(module, "extra_checkpoint", None) or {}, label_names=names)
    module.eval()
    return module, load_tokenizer(tokenizer)


def draw_text(module, tokenizer, text: str, out: str | Path, max_len: int | None = None, dpi: int = 110) -> dict:
    """Maps of one text into `out`; returns {out, tokens, layers, heads, prediction}."""
    check_has_weights(module)
    ids, labels = encode_text(module, tokenizer, text, max_len)
    device = next(module.parameters()).device
    logits, weights = attention_weights(module, ids.to(device))
    names = (getattr(module, "extra_checkpoint", {}) or {}).get("label_names")
    pred = int(logits.argmax(-1)[0])
    pred_name = names[pred] if names and pred < len(names) else str(pred)
    hp = _inner_hparams(module)
    title = (f"attention={hp.get('attention', '?')} pos={hp.get('pos', '?')}: prediction {pred_name} "
             f"(p={float(logits.softmax(-1)[0, pred]):.2f}), {len(labels)} positions")
    fig = plot_attention_maps([w[0] for w in weights], labels, out, title, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return {"out": str(out), "tokens": labels, "layers": len(weights), "heads": weights[0].size(1),
            "prediction": pred_name}


def _inner_hparams(module) -> dict:
    hp = getattr(module, "hparams", None)
    return dict(hp.get("model", {})) if hp is not None and hasattr(hp, "get") else {}


USAGE = ('usage: python scripts/attention_map.py ckpt_path=PATH text="..." [out=attention_map.png] [max_len=N] '
         '[device=cpu] [dpi=110]')


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = {"out": "attention_map.png", "max_len": None, "device": "cpu", "dpi": "110"}
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or key not in ("ckpt_path", "text", "out", "max_len", "device", "dpi"):
            print(f"attention_map: unknown argument {a!r}\n{USAGE}", file=sys.stderr)
            return 2
        args[key] = value
    if "ckpt_path" not in args or "text" not in args:
        print(f"attention_map: ckpt_path and text are required\n{USAGE}", file=sys.stderr)
        return 2
    try:
        module, tokenizer = load_checkpoint(args["ckpt_path"], args["device"])
        res = draw_text(module, tokenizer, args["text"], args["out"],
                        int(args["max_len"]) if args["max_len"] else None, int(args["dpi"]))
    except NoAttentionWeights as e:
        print(f"attention_map: {e}", file=sys.stderr)
        return 3
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{res['layers']} layers x {res['heads']} heads over {len(res['tokens'])} positions; "
          f"prediction {res['prediction']}; wrote {res['out']}")
    return 0


# ------------------------------------------------------------------------------------------ callback

class AttentionMapLogger(L.Callback):
    """Opt-in: draw the attention maps of the first `num_examples` validation examples after each
    `every_n_epochs`-th validation epoch; log them to TensorBoard / W&B loggers (others: PNG only) and
    save them as <run dir>/attention_maps/epoch<E>_ex<i>.png. Long examples are drawn over their first
    `max_tokens` queries and keys (the weights come from the full example). Models without explicit
    weights (linformer, performer) get one warning and no maps."""

    def __init__(self, num_examples: int = 2, every_n_epochs: int = 1, max_tokens: int = 64, save_png: bool = True):
        if num_examples < 1 or every_n_epochs < 1 or max_tokens < 2:
            raise ValueError("num_examples and every_n_epochs must be >= 1 and max_tokens >= 2.")
        self.num_examples, self.every_n_epochs, self.max_tokens = num_examples, every_n_epochs, max_tokens
        self.save_png = save_png
        self._examples: list[Tensor] | None = None
        self._disabled = False
        self.saved: list[Path] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self._examples is not None or self._disabled or trainer.sanity_checking:
            return
        ids, pad = batch["input_ids"], batch["padding_mask"]
        self._examples = [ids[i][~pad[i]].detach().clone().cpu() for i in range(min(self.num_examples, len(ids)))]

    def on_validation_epoch_end(self, trainer, pl_module):
        if (self._disabled or not self._examples or trainer.sanity_checking or not trainer.is_global_zero
                or (trainer.current_epoch + 1) % self.every_n_epochs):
            return
        try:
            check_has_weights(pl_module)
        except NoAttentionWeights as e:
            log.warning("AttentionMapLogger: %s; no maps will be logged.", e)
            self._disabled = True
            return
        dm = getattr(trainer, "datamodule", None)
        tokenizer = getattr(dm, "tokenizer", None)
        import matplotlib.pyplot as plt

        for i, ids in enumerate(self._examples):
            _, weights = attention_weights(pl_module, ids.unsqueeze(0).to(pl_module.device))
            labels = token_labels(tokenizer, ids.tolist()) if tokenizer is not None else [str(t) for t in ids.tolist()]
            if getattr(_inner(pl_module), "cls", None) is not None:
                labels = ["<cls>"] + labels
            n = min(self.max_tokens, len(labels))
            crop = [w[0, :, :n, :n] for w in weights]
            title = (f"epoch {trainer.current_epoch}, validation example {i}"
                     f"{f' (first {n} of {len(labels)} positions)' if n < len(labels) else ''}")
            fig = plot_attention_maps(crop, labels[:n], None, title)
            self._log_figure(trainer, fig, f"attention_maps/example_{i}")
            if self.save_png:
                path = Path(trainer.default_root_dir) / "attention_maps" / f"epoch{trainer.current_epoch:03d}_ex{i}.png"
                self.saved.append(save_png(fig, path, dpi=100))
            plt.close(fig)

    @staticmethod
    def _log_figure(trainer, fig, tag: str) -> None:
        for lg in trainer.loggers:
            name = type(lg).__name__
            try:
                if name == "TensorBoardLogger":
                    lg.experiment.add_figure(tag, fig, global_step=trainer.global_step, close=False)
                elif name == "WandbLogger":
                    import numpy as np

                    fig.canvas.draw()
                    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
                    lg.log_image(key=tag, images=[image])
            except Exception as e:  # noqa: BLE001 -- a logging problem must never stop training
                log.warning("AttentionMapLogger: could not log %s to %s: %s", tag, name, e)
