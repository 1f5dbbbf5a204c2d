"""Recurrent baselines for the task benchmark, with the Transformers calling convention.

    BiLSTMForSequenceClassification    embedding, stacked BiLSTM, max-pool over real tokens, linear
    BiLSTMForTokenClassification       the same encoder, a linear layer per token
    SlicedRNNForSequenceClassification SRNN (Yu & Liu, COLING 2018) and BPIE-SRNN / BPIE-BiSRNN: GRUs over short
                                       slices of the document, then a GRU over the slice representations

Every model takes `forward(input_ids, attention_mask=None, labels=None, **kwargs)` and returns a
`SequenceClassifierOutput` / `TokenClassifierOutput`. Only the real tokens (attention mask 1) of a row are read, from
its first real token on, so its outputs do not depend on the padding around it; a row of padding only gives finite
outputs (its features are zeros).

    model = baseline_for("bpie-bisrnn", vocab_size=30522, embedding_size=128, hidden_size=64, num_labels=5)
    count_parameters(model)  # without the embedding, to match model sizes
"""

from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from transformers.modeling_outputs import SequenceClassifierOutput, TokenClassifierOutput


PROBLEM_TYPES = ("single_label_classification", "multi_label_classification")
POOLINGS = ("max", "mean", "last")


def count_parameters(module: nn.Module, exclude=("embed",)) -> int:
    """Number of parameters whose qualified name contains none of `exclude` (by default: all but the embeddings)."""
    if isinstance(exclude, str):
        exclude = (exclude,)
    return sum(p.numel() for name, p in module.named_parameters() if not any(part in name for part in exclude))


def _check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_common(vocab_size, embedding_size, hidden_size, num_labels, problem_type, dropout, pad_token_id):
    _check_positive(
        vocab_size=vocab_size, embedding_size=embedding_size, hidden_size=hidden_size, num_labels=num_labels
    )
    if problem_type not in PROBLEM_TYPES:
        raise ValueError(f"problem_type must be one of {PROBLEM_TYPES}, got {problem_type!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id must be an integer in [0, vocab_size), got {pad_token_id!r}")


def _left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Move each row's real tokens to its front, in order; returns the ids, the real lengths and the permutation.

    The benchmark pads on the right, where the permutation is the identity; left or inner padding then behaves the
    same way.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    padding = attention_mask == 0
    order = torch.argsort(padding.to(torch.uint8), dim=1, stable=True)
    return input_ids.gather(1, order), (~padding).sum(1), order


def _run_packed(rnn: nn.RNNBase, inputs: torch.Tensor, lengths: torch.Tensor):
    """Run `rnn` over the first `lengths[i]` steps of each row of `inputs` (batch first).

    Returns the outputs, zero past each row's length, and the final hidden states (num_layers * directions, rows,
    hidden). Rows of length 0 cannot be packed: they are left out and get zeros.
    """
    rows, steps = inputs.shape[:2]
    directions = 2 if rnn.bidirectional else 1
    outputs = inputs.new_zeros(rows, steps, directions * rnn.hidden_size)
    final = inputs.new_zeros(rnn.num_layers * directions, rows, rnn.hidden_size)
    kept = (lengths > 0).nonzero().squeeze(1)
    if len(kept) == 0:
        return outputs, final
    packed = pack_padded_sequence(inputs[kept], lengths[kept].cpu(), batch_first=True, enforce_sorted=False)
    packed_outputs, kept_final = rnn(packed)
    if isinstance(kept_final, tuple):  # an LSTM's (h_n, c_n)
        kept_final = kept_final[0]
    kept_outputs, _ = pad_packed_sequence(packed_outputs, batch_first=True, total_length=steps)
    if len(kept) == rows:
        return kept_outputs, kept_final
    return outputs.index_copy(0, kept, kept_outputs), final.index_copy(1, kept, kept_final)


def _pool(outputs: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, poolings) -> torch.Tensor:
    """Concatenate the `poolings` of `outputs` (rows, steps, features) over the steps where `mask` is true.

    "last" is taken as given (`last`, rows x features), since which step is last depends on the reading direction.
    Rows without any step pool to zeros.
    """
    counts = mask.sum(1, keepdim=True)
    pooled = []
    for name in poolings:
        if name == "max":
            maximum = outputs.masked_fill(~mask[..., None], float("-inf")).amax(1)
            pooled.append(maximum.masked_fill(counts == 0, 0.0))
        elif name == "mean":
            pooled.append((outputs * mask[..., None]).sum(1) / counts.clamp(min=1))
        else:
            pooled.append(last)
    return torch.cat(pooled, dim=-1)


def _sequence_loss(logits, labels, problem_type):
    if labels is None:
        return None
    if problem_type == "multi_label_classification":
        return nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _reverse_real(states: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first `lengths[i]` steps, leaving the padding after them in place (its own inverse)."""
    steps = torch.arange(states.shape[1], device=states.device)[None, :]
    index = torch.where(steps < lengths[:, None], lengths[:, None] - 1 - steps, steps)
    return states.gather(1, index[..., None].expand_as(states))


class _BiLSTMEncoder(nn.Module):
    """Embedding, dropout and a stacked bidirectional LSTM over each row's real tokens.

    Each direction is its own LSTM over left-aligned rows (the backward one over each row's real tokens reversed), so
    padding only ever follows the real tokens and cannot reach their outputs. This avoids packed sequences, whose CPU
    backward pass is ten times slower when the rows of a batch differ in length.
    """

    def __init__(self, vocab_size, embedding_size, hidden_size, num_layers, dropout, pad_token_id):
        super().__init__()
        _check_positive(num_layers=num_layers)
        self.embeddings = nn.Embedding(vocab_size, embedding_size, padding_idx=pad_token_id)
        self.dropout = nn.Dropout(dropout)
        sizes = [embedding_size] + [2 * hidden_size] * (num_layers - 1)
        self.forward_lstms = nn.ModuleList(nn.LSTM(size, hidden_size, batch_first=True) for size in sizes)
        self.backward_lstms = nn.ModuleList(nn.LSTM(size, hidden_size, batch_first=True) for size in sizes)

    def forward(self, input_ids, attention_mask):
        """Outputs of the last layer for the left-aligned real tokens (zeros after them), lengths, permutation."""
        ids, lengths, order = _left_align(input_ids, attention_mask)
        real = (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None])[..., None]
        states = self.dropout(self.embeddings(ids))
        for layer, (forward_lstm, backward_lstm) in enumerate(zip(self.forward_lstms, self.backward_lstms)):
            if layer > 0:
                states = self.dropout(states)  # between layers, as nn.LSTM's own dropout
            forward_states, _ = forward_lstm(states)
            backward_states, _ = backward_lstm(_reverse_real(states, lengths))
            states = torch.cat([forward_states, _reverse_real(backward_states, lengths)], dim=-1) * real
        return states, lengths, order


class _BiLSTMModel(nn.Module):
    """What both BiLSTM models share: the encoder, dropout and a linear layer over its 2h-wide outputs."""

    def __init__(
        self,
        *,
        vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        num_labels: int,
        problem_type: str = "single_label_classification",
        num_layers: int = 2,
        dropout: float = 0.1,
        pad_token_id: int = 0,
    ):
        super().__init__()
        _check_common(vocab_size, embedding_size, hidden_size, num_labels, problem_type, dropout, pad_token_id)
        self.num_labels = num_labels
        self.problem_type = problem_type
        self.encoder = _BiLSTMEncoder(vocab_size, embedding_size, hidden_size, num_layers, dropout, pad_token_id)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(2 * hidden_size, num_labels)


class BiLSTMForSequenceClassification(_BiLSTMModel):
    """Embedding, dropout, `num_layers` BiLSTM layers, max-pool over the real tokens, dropout, linear."""

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs) -> SequenceClassifierOutput:
        outputs, lengths, _ = self.encoder(input_ids, attention_mask)
        real = torch.arange(outputs.shape[1], device=outputs.device) < lengths[:, None]
        features = _pool(outputs, real, None, ("max",))
        logits = self.classifier(self.dropout(features))
        return SequenceClassifierOutput(loss=_sequence_loss(logits, labels, self.problem_type), logits=logits)


class BiLSTMForTokenClassification(_BiLSTMModel):
    """The BiLSTM encoder with a linear layer per token; labels -100 are ignored by the loss."""

    def __init__(self, *, problem_type: str = "single_label_classification", **kwargs):
        if problem_type != "single_label_classification":
            raise ValueError(f"problem_type must be 'single_label_classification' for tokens, got {problem_type!r}")
        super().__init__(problem_type=problem_type, **kwargs)

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs) -> TokenClassifierOutput:
        outputs, _, order = self.encoder(input_ids, attention_mask)
        # Back to the input's token positions (a no-op for right padding).
        outputs = torch.zeros_like(outputs).scatter(1, order[..., None].expand_as(outputs), outputs)
        logits = self.classifier(self.dropout(outputs))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1), ignore_index=-100)
        return TokenClassifierOutput(loss=loss, logits=logits)


class Slices(NamedTuple):
    """The slices of a batch of documents, in document order, each as the token positions a GRU reads."""

    document: torch.Tensor  # (slices,) the row of each slice
    number: torch.Tensor  # (slices,) k: the slice's place in its document
    positions: torch.Tensor  # (slices, slice_length + enrichment) positions in reading order, -1 past `lengths`
    lengths: torch.Tensor  # (slices,) positions read: the enrichment, then the slice's own tokens
    enrichment: torch.Tensor  # (slices,) how many of them come from the neighbouring slice


def slice_documents(lengths: torch.Tensor, slice_length: int, enrichment: int = 0, reverse: bool = False) -> Slices:
    """Cut documents of `lengths` real tokens (from position 0) into slices of `slice_length`; the last may be shorter.

    Forward (`reverse=False`), slice k is read as [the last `enrichment` tokens of slice k-1; slice k]; backward,
    as [slice k; the first `enrichment` tokens of slice k+1] in reverse order. Either way the enrichment tokens come
    first in reading order and the slice's own tokens follow, so its final state is the "last" output. Slices at the
    ends of a document read only what exists (no zero padding in place of slice -1 or n).
    """
    steps = torch.arange(slice_length + enrichment, device=lengths.device)
    counts = (lengths + slice_length - 1) // slice_length  # 0 for an empty document
    document = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), counts)
    number = torch.arange(len(document), device=lengths.device) - (counts.cumsum(0) - counts)[document]
    start = number * slice_length
    own = (lengths[document] - start).clamp(max=slice_length)
    if reverse:
        extra = (lengths[document] - start - own).clamp(min=0, max=enrichment)
        positions = (start + own + extra - 1)[:, None] - steps
    else:
        extra = start.clamp(max=enrichment)  # slice 0 has no predecessor
        positions = (start - extra)[:, None] + steps
    read = own + extra
    positions = positions.masked_fill(steps >= read[:, None], -1)
    return Slices(document, number, positions, read, extra)


class SlicedRNNForSequenceClassification(nn.Module):
    """SRNN, BiSRNN, BPIE-SRNN and BPIE-BiSRNN: a GRU over slices, a GRU over the slices' representations.

    Each document (its real tokens, from the first) is cut into slices of `slice_length` (z) tokens. A forward GRU
    reads every slice of every document in one batched call; with `enrichment` m > 0 it first reads the last m tokens
    of the previous slice of the same document (the first slice reads nothing extra: only real tokens are read, where
    the paper zero-pads). With `bidirectional`, a backward GRU reads the slice followed by the first m tokens of the
    next slice, in reverse. The outputs over the slice's own tokens are pooled with each of `poolings` ("last": the
    forward GRU's output at the slice's last token, the backward GRU's at its first, i.e. each one's final state) and
    concatenated into r_k. A second GRU (bidirectional with `bidirectional`) reads r_0 .. r_{n-1}; its outputs are
    pooled the same way ("last": each direction's final state), then dropout and a linear layer give the logits.

    SRNN: `poolings=("last",)`, `enrichment=0`, one direction (the defaults); BPIE-BiSRNN: `bidirectional=True`,
    `enrichment=5`, `poolings=("max", "mean", "last")`.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        num_labels: int,
        problem_type: str = "single_label_classification",
        slice_length: int = 32,
        enrichment: int = 0,
        bidirectional: bool = False,
        poolings=("last",),
        dropout: float = 0.1,
        pad_token_id: int = 0,
    ):
        super().__init__()
        _check_common(vocab_size, embedding_size, hidden_size, num_labels, problem_type, dropout, pad_token_id)
        _check_positive(slice_length=slice_length)
        if isinstance(enrichment, bool) or not isinstance(enrichment, int) or not 0 <= enrichment < slice_length:
            raise ValueError(f"enrichment must be an integer in [0, slice_length={slice_length}), got {enrichment!r}")
        poolings = (poolings,) if isinstance(poolings, str) else tuple(poolings)
        if not poolings or any(name not in POOLINGS for name in poolings) or len(set(poolings)) < len(poolings):
            raise ValueError(f"poolings must be distinct names from {POOLINGS}, got {poolings!r}")
        self.num_labels = num_labels
        self.problem_type = problem_type
        self.slice_length = slice_length
        self.enrichment = enrichment
        self.bidirectional = bool(bidirectional)
        self.poolings = poolings
        directions = 2 if self.bidirectional else 1
        slice_features = directions * hidden_size * len(poolings)

        self.embeddings = nn.Embedding(vocab_size, embedding_size, padding_idx=pad_token_id)
        # Two one-way GRUs rather than one bidirectional GRU, as the directions read different tokens.
        self.forward_gru = nn.GRU(embedding_size, hidden_size, batch_first=True)
        self.backward_gru = nn.GRU(embedding_size, hidden_size, batch_first=True) if self.bidirectional else None
        self.document_gru = nn.GRU(slice_features, hidden_size, batch_first=True, bidirectional=self.bidirectional)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(directions * hidden_size * len(poolings), num_labels)

    def _read_slices(self, gru, embeddings, slices):
        rows, steps, width = embeddings.shape
        positions = slices.document[:, None] * steps + slices.positions.clamp(min=0)  # past the end: ignored
        outputs, final = _run_packed(gru, embeddings.reshape(rows * steps, width)[positions], slices.lengths)
        reading = torch.arange(outputs.shape[1], device=outputs.device)
        own = (reading >= slices.enrichment[:, None]) & (reading < slices.lengths[:, None])
        return _pool(outputs, own, final[-1], self.poolings)

    def slice_representations(self, input_ids, attention_mask=None):
        """r_k for every slice of every document (slices x features), and the forward `Slices` that locate them."""
        ids, lengths, _ = _left_align(input_ids, attention_mask)
        embeddings = self.embeddings(ids)
        slices = slice_documents(lengths, self.slice_length, self.enrichment)
        representations = [self._read_slices(self.forward_gru, embeddings, slices)]
        if self.bidirectional:
            backward = slice_documents(lengths, self.slice_length, self.enrichment, reverse=True)
            representations.append(self._read_slices(self.backward_gru, embeddings, backward))
        return torch.cat(representations, dim=-1), slices

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs) -> SequenceClassifierOutput:
        representations, slices = self.slice_representations(input_ids, attention_mask)
        rows = input_ids.shape[0]
        counts = torch.bincount(slices.document, minlength=rows)
        longest = max(int(counts.max()), 1) if rows else 1
        documents = representations.new_zeros(rows, longest, representations.shape[-1])
        documents = documents.index_put((slices.document, slices.number), representations)
        outputs, final = _run_packed(self.document_gru, documents, counts)
        real = torch.arange(longest, device=counts.device) < counts[:, None]
        last = final.transpose(0, 1).reshape(rows, -1)  # [forward; backward] final states, as in the outputs
        logits = self.classifier(self.dropout(_pool(outputs, real, last, self.poolings)))
        return SequenceClassifierOutput(loss=_sequence_loss(logits, labels, self.problem_type), logits=logits)


BASELINES = {
    "bilstm": (BiLSTMForSequenceClassification, {}),
    "srnn": (SlicedRNNForSequenceClassification, {"bidirectional": False, "enrichment": 0, "poolings": ("last",)}),
    "bpie-bisrnn": (
        SlicedRNNForSequenceClassification,
        {"bidirectional": True, "enrichment": 5, "poolings": ("max", "mean", "last")},
    ),
}


def baseline_for(name: str, **kwargs) -> nn.Module:
    """The sequence classifier `name` ("bilstm", "srnn" or "bpie-bisrnn") with its defaults, overridden by kwargs."""
    if name not in BASELINES:
        raise ValueError(f"name must be one of {sorted(BASELINES)}, got {name!r}")
    cls, defaults = BASELINES[name]
    return cls(**{**defaults, **kwargs})
