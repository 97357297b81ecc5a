"""A text as the model's positions: its ids, and a short readable label for each position."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mhalab.analysis.attention_maps.weights import inner

WHITESPACE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


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
            labels.append(WHITESPACE.get(text, text if text.isprintable() else f"0x{int(i) - 4:02x}"))
        else:
            labels.append(tok)
    return [lab if len(lab) <= 12 else lab[:11] + "…" for lab in labels]


def position_labels(model: nn.Module, labels: list[str]) -> list[str]:
    """The labels of the model's positions from its tokens': with pooling=cls it prepends its own vector."""
    return ["<cls>", *labels] if getattr(inner(model), "cls", None) is not None else labels


def encode_text(model: nn.Module, tokenizer, text: str, max_len: int | None = None) -> tuple[Tensor, list[str]]:
    """(input_ids (1, T), labels of the model's positions) for one text, truncated to `max_len` ids
    (default: the model's max_len; checkpoint.Loaded.max_len is the one training used)."""
    from mhalab.data.tokenizer import encode_texts

    ids = encode_texts(tokenizer, [text], max_len or _model_max_len(model))[0]
    return torch.tensor([ids], dtype=torch.long), position_labels(model, token_labels(tokenizer, ids))


def _model_max_len(model: nn.Module) -> int:
    hp = getattr(model, "hparams", None)
    max_len = dict(hp.get("model", {})).get("max_len") if hp is not None and hasattr(hp, "get") else None
    if max_len is None:
        raise ValueError("cannot tell the model's max_len (no hparams.model.max_len); pass max_len=...")
    return int(max_len)
