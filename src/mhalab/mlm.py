"""Masked-LM pretraining of a SequenceClassifier's encoder (BERT's objective, Devlin et al. 2019, §3.1).

    # the classifier's embedding, positions and encoder, with a masked-LM head
    mlm = MaskedLanguageModel(classifier, special_ids, first_normal_id)
    # packed (N,) ids: 15% chosen, 80/10/10, predicted
    loss, chosen, correct = mlm(input_ids, seqlens)
    # then fine-tune on the labels
    classifier.load_state_dict(mlm.backbone_state())

Of the real tokens (never [CLS] / [SEP] / pads), `mask_prob` are chosen; of those 80% are replaced by a
learned [MASK] vector, 10% by a random token, 10% kept; the model predicts the original token at every chosen
position. The output layer is the input embedding, transposed (weights tied, as in BERT), after BERT's
transform (linear -> GELU -> LayerNorm), scaled by dim^-1/2 (T5's tied output) and with its own bias.

The [MASK] vector is a parameter of this module, not a row of the tokenizer's vocabulary: the tokenizer and
the classifier's embedding stay exactly the ones a run without pretraining has, and fine-tuning never sees
a token it did not have. The classifier's head is not trained here (backbone_state leaves it out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhalab.model import SequenceClassifier
from mhalab.nn.varlen import SeqLens

MASK_PROB = 0.15
SPLIT = (0.8, 0.1, 0.1)  # of the chosen tokens: [MASK], a random token, unchanged (BERT's 80/10/10)


def choose_masked(input_ids: Tensor, special_ids: Tensor, vocab_size: int, first_normal_id: int,
                  mask_prob: float = MASK_PROB, generator: torch.Generator | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """BERT's corruption of packed ids.

    Args:
        input_ids: (N,) packed ids.
        special_ids: the ids never chosen ([CLS], [SEP], pads).
        vocab_size: the vocabulary's size.
        first_normal_id: the first id that is no special token (random replacements come from
            [first_normal_id, vocab_size)).
        mask_prob: each real token's probability of being chosen (at least one per batch).
        generator: the random draws' generator.

    Returns:
        `(chosen, to_mask, corrupted)`: chosen (N,) bool, the positions to predict; to_mask (N,) bool, 80% of
        them, whose embedding becomes the [MASK] vector; corrupted (N,) ids, where 10% of the chosen carry a
        random token (never a special) and the rest their own id.
    """
    dev = input_ids.device
    candidate = ~torch.isin(input_ids, special_ids)  # (N,) real tokens only
    draw = torch.rand(input_ids.shape, device=dev, generator=generator)
    chosen = candidate & (draw < mask_prob)
    # a tiny batch may draw none: then predict its first real token all the same (tensor ops: no host sync on CUDA)
    first = candidate & (candidate.cumsum(0) == 1)
    chosen = chosen | (first & ~chosen.any())
    # one more uniform number decides each chosen token's fate: [0, .8) mask, [.8, .9) random, [.9, 1) keep
    fate = torch.rand(input_ids.shape, device=dev, generator=generator)
    to_mask = chosen & (fate < SPLIT[0])
    to_random = chosen & (fate >= SPLIT[0]) & (fate < SPLIT[0] + SPLIT[1])
    random_ids = torch.randint(first_normal_id, vocab_size, input_ids.shape, device=dev, generator=generator)
    return chosen, to_mask, torch.where(to_random, random_ids, input_ids)


class MaskedLanguageModel(nn.Module):
    """A classifier's embedding, positions and encoder with BERT's masked-LM head on top.

    Args:
        backbone: the SequenceClassifier whose embedding, positions and encoder are pretrained (its head is not).
        special_ids: the ids never chosen ([CLS], [SEP], pads).
        first_normal_id: the first id that is no special token.
        mask_prob: the share of real tokens chosen (BERT's 15%).

    Raises:
        ValueError: mask_prob outside (0, 1).
    """

    def __init__(self, backbone: SequenceClassifier, special_ids: tuple[int, ...], first_normal_id: int,
                 mask_prob: float = MASK_PROB):
        super().__init__()
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob={mask_prob} must be in (0, 1), e.g. {MASK_PROB}.")
        self.backbone, self.mask_prob, self.first_normal_id = backbone, mask_prob, first_normal_id
        dim = backbone.embed.embedding_dim
        self.register_buffer("special_ids", torch.tensor(special_ids, dtype=torch.long), persistent=False)
        self.mask_vector = nn.Parameter(torch.randn(dim) * 0.02)  # [MASK]'s embedding
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.bias = nn.Parameter(torch.zeros(backbone.embed.num_embeddings))

    @property
    def vocab_size(self) -> int:
        return self.backbone.embed.num_embeddings

    def forward(self, input_ids: Tensor, seqlens: SeqLens, generator: torch.Generator | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """The masked-LM loss of a packed batch (a padded batch's ids go through SeqLens.padded_index first: the
        collate gives both).

        Args:
            input_ids: (N,) packed ids.
            seqlens: the lengths of its sequences.
            generator: the corruption's random draws.

        Returns:
            `(loss, chosen, correct)`: the mean cross-entropy over the chosen tokens, their number, and how many
            were predicted right.
        """
        chosen, to_mask, ids = choose_masked(input_ids, self.special_ids, self.vocab_size, self.first_normal_id,
                                             self.mask_prob, generator)
        emb = self.backbone.embed(ids)  # (N, E)
        emb = torch.where(to_mask.unsqueeze(-1), self.mask_vector.to(emb.dtype), emb)
        x, out_lens = self.backbone.encode(ids, seqlens, embeddings=emb)  # (N', E)
        chosen_rows = chosen.nonzero().squeeze(1)  # (M,) the chosen tokens' packed rows (on CUDA a sync)
        rows = chosen_rows
        if out_lens is not seqlens:  # pooling=cls: a CLS row before each sequence shifts its tokens' rows
            rows = rows + seqlens.sequence(rows.device).index_select(0, rows) + 1
        h = self.transform(x.index_select(0, rows))  # (M, E)
        # (M, V): the embedding, transposed. Its rows are N(0, 1) (nn.Embedding's init, which the classifier keeps),
        # so h . e has std sqrt(E): scaled by E^-1/2 as T5 does with its tied output layer, the first loss is ~ln V
        logits = F.linear(h * h.size(-1) ** -0.5, self.backbone.embed.weight, self.bias)
        targets = input_ids.index_select(0, chosen_rows)  # (M,) the original tokens
        loss = F.cross_entropy(logits.float(), targets)
        return loss, torch.tensor(targets.numel()), (logits.argmax(-1) == targets).sum()

    def backbone_state(self) -> dict[str, Tensor]:
        """The encoder's weights for a SequenceClassifier of the same shape: everything but the classifier head."""
        return {k: v for k, v in self.backbone.state_dict().items() if not k.startswith("head.")}
