"""Tokenizers: WordPiece, byte-level BPE or word-level (whitespace) trained with HF `tokenizers`, or raw
bytes (no training).

Every kind is a plain `tokenizers.Tokenizer`, so one JSON string describes it completely: a
checkpoint can carry it and evaluation needs nothing else. Ids 0..3 are always the specials below
(pad id 0, which the model's embedding and the collate rely on), and every text is encoded as
`[CLS] tokens [SEP]`, truncated to `max_len` tokens in total.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
PAD_ID, UNK_ID, CLS_ID, SEP_ID = range(len(SPECIALS))
KINDS = ("wordpiece", "bpe", "bytes", "word")
BYTE_VOCAB_SIZE = len(SPECIALS) + 256


def min_vocab_size(kind: str) -> int:
    """Smallest vocab_size a kind can honour: byte-level BPE must hold its 256-symbol alphabet."""
    return {"wordpiece": len(SPECIALS) + 1, "bpe": BYTE_VOCAB_SIZE, "bytes": 0, "word": len(SPECIALS) + 1}[kind]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of tokenizers' ByteLevel pre-tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _lowercase(lowercase: bool) -> normalizers.Normalizer:
    return normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()] if lowercase else [normalizers.NFKC()])


def _add_cls_sep(tok: Tokenizer) -> Tokenizer:
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)]
    )
    return tok


def byte_tokenizer(lowercase: bool = False) -> Tokenizer:
    """Byte-level ids with no training: byte b -> id 4 + b (ids 0..3 are the specials).

    Built as a BPE with no merges over the ByteLevel alphabet, with no word splitting
    (use_regex=False), so every UTF-8 byte of the text becomes exactly one token.
    """
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + b for b, ch in _bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return _add_cls_sep(tok)


def train_tokenizer(
    texts: Sequence[str], kind: str = "wordpiece", vocab_size: int = 8000, lowercase: bool = True,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a tokenizer on `texts` (the train split only: dev/test must not shape the vocabulary)."""
    if kind == "bytes":
        return byte_tokenizer(lowercase)
    if kind == "wordpiece":
        tok = _train_wordpiece(texts, vocab_size, lowercase, min_frequency)
    elif kind == "word":
        # word-level: every whitespace-separated token is one id (ListOps' `[MAX`, `]`, digits)
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.normalizer = _lowercase(lowercase)
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.train_from_iterator(texts, length=len(texts), trainer=trainers.WordLevelTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIALS, show_progress=False))
    elif kind == "bpe":
        # GPT-2's recipe: byte-level, so no [UNK] ever; the 256 byte symbols are always in the vocab.
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.normalizer = _lowercase(lowercase)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, length=len(texts), trainer=trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    else:
        raise ValueError(f"tokenizer kind '{kind}' is not supported; choose one of {list(KINDS)}.")
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS))), "specials must be ids 0..3"
    return _add_cls_sep(tok)


def _train_wordpiece(texts: Sequence[str], vocab_size: int, lowercase: bool, min_frequency: int) -> Tokenizer:
    """BERT's recipe: split on whitespace and punctuation, '##' marks word-internal pieces; the same
    vocabulary in every process.

    tokenizers' trainer gives each '##c' piece an id in the order it meets the words, which is a hash
    map's (random per process), and breaks ties between equally frequent merges by those ids: the same
    texts gave a different vocabulary in every run (huggingface/tokenizers#1794). Declaring every piece
    up front, in sorted order, fixes their ids; they are then removed from the special tokens, so they
    are ordinary vocabulary, as the trainer would have made them.
    """
    def train(vocab_size: int, specials: list[str]) -> Tokenizer:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(texts, length=len(texts), trainer=trainers.WordPieceTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials, show_progress=False))
        return tok

    # with no room for merges the trainer returns its alphabet: the characters and the '##c' pieces
    pieces = sorted(t for t in train(0, SPECIALS).get_vocab() if t.startswith("##"))
    tok = train(vocab_size, SPECIALS + pieces)

    # the same vocabulary in a tokenizer whose only special tokens are SPECIALS
    out = Tokenizer(models.WordPiece(vocab=tok.get_vocab(), unk_token="[UNK]"))
    out.normalizer, out.pre_tokenizer, out.decoder = tok.normalizer, tok.pre_tokenizer, decoders.WordPiece()
    out.add_special_tokens(SPECIALS)
    return out


def load_tokenizer(tokenizer: Tokenizer | str) -> Tokenizer:
    """A Tokenizer from itself or from its JSON string (as `Tokenizer.to_str()` writes it)."""
    return tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.from_str(tokenizer)


def encode_texts(tokenizer: Tokenizer | str, texts: Iterable[str], max_len: int) -> list[list[int]]:
    """Token ids of each text, `[CLS] ... [SEP]`, truncated to at most `max_len` ids.

    Works on a copy, so the caller's tokenizer keeps its own truncation settings.
    """
    if max_len < 3:
        raise ValueError(f"max_len must be >= 3 ([CLS], [SEP] and one token), got {max_len}.")
    tok = Tokenizer.from_str(load_tokenizer(tokenizer).to_str())
    tok.enable_truncation(max_length=max_len)
    tok.no_padding()
    texts = list(texts)
    # encode_batch_fast skips computing character offsets, which we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=True)]
