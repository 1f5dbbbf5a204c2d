"""Adaptive input embeddings and the adaptive softmax (Baevski & Auli, 2019; Grave et al., 2017) of the official
`RanNetForAdaptiveLM`, for the causal LM with `config.cutoffs`.

The vocabulary is cut at `cutoffs` into a head cluster of frequent ids and tail clusters of rarer ones; cluster i
embeds its ids in `hidden_size // div_val**i` dimensions and projects them to `hidden_size`. The softmax shares those
embeddings and projections (the official model binds them): a hidden state h is projected back into each cluster
(x_i = h P_i), the head scores its ids and one logit per tail cluster, and a tail's ids get the tail's own softmax plus
the head's log-probability of that tail. With `div_val == 1` the official layers use one embedding and no projection,
and their softmax is one tied softmax over the whole vocabulary: `cutoffs` change nothing there, and here neither.

This module reads only plain sizes and holds no reference to `RANConfig`; `modeling_ran` builds it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .building_blocks import apply_dropout
from .label_checks import check_num_items_in_batch


def cluster_bounds(vocab_size: int, cutoffs: list[int], div_val: int) -> list[int]:
    """[0, c_1, ..., vocab_size]: cluster i holds ids [bounds[i], bounds[i + 1]). One cluster when `div_val == 1`."""
    if div_val == 1:
        return [0, vocab_size]
    return [0, *cutoffs, vocab_size]


class RANAdaptiveEmbedding(nn.Module):
    """Token ids (..., ) -> (..., hidden_size): each id's cluster embedding, projected to `hidden_size`."""

    def __init__(self, vocab_size: int, hidden_size: int, cutoffs: list[int], div_val: int):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs, div_val)
        sizes = [hidden_size // div_val**i for i in range(len(self.bounds) - 1)]
        self.clusters = nn.ModuleList(
            nn.Embedding(high - low, size) for low, high, size in zip(self.bounds[:-1], self.bounds[1:], sizes)
        )
        # Projection i maps cluster i's embedding to the hidden size (official `kernel-i`, (size, hidden) = our
        # weight transposed). None with `div_val == 1`, as in the official layer.
        self.projections = (
            nn.ModuleList(nn.Linear(size, hidden_size, bias=False) for size in sizes) if div_val > 1 else None
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.projections is None:
            return self.clusters[0](input_ids)
        # Every id through every cluster, kept where it belongs: no data-dependent shapes (no host synchronisation);
        # the extra work is a few small products per token.
        embedded = 0
        for low, high, cluster, projection in zip(self.bounds[:-1], self.bounds[1:], self.clusters, self.projections):
            inside = (input_ids >= low) & (input_ids < high)  # (...)
            local = torch.where(inside, input_ids - low, 0)
            embedded = embedded + projection(cluster(local)) * inside[..., None]  # (..., D)
        return embedded


class RANClusterBiases(nn.ParameterList):
    """The adaptive softmax's output bias of each cluster (official `bias-i`): a module of their own, so that
    `_init_weights` reaches them (Transformers skips a module without parameters of its own, as their owner is)."""


class RANAdaptiveSoftmax(nn.Module):
    """Log-probabilities over the vocabulary from hidden states, with the adaptive embedding's clusters as output
    embeddings and projections. Its own parameters: each cluster's output bias and the head's tail-cluster logits
    (official `bias-i`, `kernel-cluster`, `bias-cluster`)."""

    def __init__(self, vocab_size: int, hidden_size: int, cutoffs: list[int], div_val: int):
        super().__init__()
        self.bounds = cluster_bounds(vocab_size, cutoffs, div_val)
        self.biases = RANClusterBiases(
            nn.Parameter(torch.zeros(high - low)) for low, high in zip(self.bounds[:-1], self.bounds[1:])
        )
        num_tails = len(self.bounds) - 2
        self.tail_logits = nn.Linear(hidden_size, num_tails) if num_tails else None  # reads x_0, like the head

    def cluster_logits(self, hidden: torch.Tensor, embedding: RANAdaptiveEmbedding, i: int) -> torch.Tensor:
        """(N, D) hidden states -> (N, size of cluster i) scores of the cluster's ids, and x_i (N, d_i)."""
        projected = hidden if embedding.projections is None else hidden @ embedding.projections[i].weight  # (N, d_i)
        return F.linear(projected, embedding.clusters[i].weight, self.biases[i]), projected

    def head_log_probs(self, hidden: torch.Tensor, embedding: RANAdaptiveEmbedding) -> torch.Tensor:
        """(N, D) -> (N, head ids + tail clusters) log-probabilities of the head's ids and of each tail cluster."""
        logits, projected = self.cluster_logits(hidden, embedding, 0)
        if self.tail_logits is not None:
            logits = torch.cat([logits, self.tail_logits(projected)], dim=-1)
        return logits.float().log_softmax(-1)

    def tail_log_probs(self, hidden, embedding, i: int, head: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, ids of tail cluster i) log-probabilities, given the head's (N, ...) log-probabilities."""
        logits, _ = self.cluster_logits(hidden, embedding, i)
        head_size = self.bounds[1]
        return logits.float().log_softmax(-1) + head[:, head_size + i - 1, None]

    def forward(self, hidden: torch.Tensor, embedding: RANAdaptiveEmbedding) -> torch.Tensor:
        """(..., D) -> (..., V) float32 log-probabilities of every id (the full distribution, for generation)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        head = self.head_log_probs(flat, embedding)
        parts = [head[:, : self.bounds[1]]]
        parts += [self.tail_log_probs(flat, embedding, i, head) for i in range(1, len(self.bounds) - 1)]
        return torch.cat(parts, dim=-1).view(*hidden.shape[:-1], -1)

    def target_log_probs(self, hidden: torch.Tensor, targets: torch.Tensor, embedding) -> torch.Tensor:
        """(N, D) hidden states and (N,) target ids in the vocabulary -> (N,) float32 log-probability of each target.

        Only the head is scored for every token; a tail cluster's softmax is computed for the tokens whose target is
        in it, so no (N, V) tensor is ever built.
        """
        head = self.head_log_probs(hidden, embedding)  # (N, head ids + tails)
        head_size = self.bounds[1]
        in_head = targets < head_size
        result = head.gather(1, torch.where(in_head, targets, 0)[:, None]).squeeze(1)
        for i in range(1, len(self.bounds) - 1):
            low, high = self.bounds[i], self.bounds[i + 1]
            rows = ((targets >= low) & (targets < high)).nonzero().squeeze(1)  # (n,)
            if rows.numel() == 0:
                continue
            tail = self.tail_log_probs(hidden[rows], embedding, i, head[rows])  # (n, high - low)
            result = result.index_copy(0, rows, tail.gather(1, (targets[rows] - low)[:, None]).squeeze(1))
        return result


def adaptive_lm_loss(
    softmax: RANAdaptiveSoftmax,
    embedding: RANAdaptiveEmbedding,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    **kwargs,
) -> torch.Tensor:
    """Next-token loss with Transformers' conventions (`ForCausalLMLoss`): position t predicts `labels[t + 1]` (or
    `shift_labels[t]`), `ignore_index` is skipped, the summed loss is divided by `num_items_in_batch` when given
    (gradient accumulation over a whole batch) and otherwise averaged over the scored tokens (0 when none).

    `num_items_in_batch` of 0 (or less) is refused: Transformers' losses would divide by it and give inf or NaN.
    """
    check_num_items_in_batch(num_items_in_batch, read_device=True)  # the loss synchronises anyway (`nonzero`)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    scored = (targets != ignore_index).nonzero().squeeze(1)
    total = -softmax.target_log_probs(hidden[scored], targets[scored], embedding).sum()
    total = total + hidden.sum() * 0.0  # attached to every hidden state even with nothing scored: backward() runs
    if num_items_in_batch is None:
        return total / max(1, scored.numel())
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class RANOutputMapping(nn.Module):
    """What the official adaptive LM puts between the last layer and its softmax: dropout, then swish(Dense)."""

    def __init__(self, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout_prob)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.silu(self.dense(apply_dropout(self.dropout, hidden_states)))
