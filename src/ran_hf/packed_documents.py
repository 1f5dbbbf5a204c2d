"""Packed documents (padding-free training): several documents in one row, read as if each were alone.

Transformers' `DataCollatorWithFlattening` concatenates a batch's documents into one row and marks where each starts:
`position_ids` that restart (0, 1, 2, 0, 1, ...), and with `return_flash_attn_kwargs=True` the cumulative lengths
`cu_seq_lens_q`/`cu_seq_lens_k` that flash attention's varlen kernels read; `return_seq_idx=True` adds `seq_idx`, the
document of every token. A RAN carries a cell, a memory of cells, an associative memory and a token shift from window
to window, and its windows are counted from a sequence's first token: read as one sequence, the second document would
start from the first one's state. So `RANModel` regroups a packed row's documents into a padded batch, one document a
row, runs its ordinary path over that batch (exact under padding, whatever the side), and puts every per-token output
back in the packed layout. Per-document outputs (cells, pooled cell, pooler output) have one row per document.

Whether a call is packed is decided from cheap signals: only a call that passes `position_ids`, `seq_idx` or
`cu_seq_lens_*` pays for one host read, of a few sizes; any other call runs as before.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .input_checks import input_batch_shape
from .outputs_ran import RANModelOutput
from .window_layout import group_starts, true_positions


# Keyword arguments that mark document boundaries (Transformers' names), and the ones that only describe them.
BOUNDARY_KWARGS = ("position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")
DESCRIPTIVE_KWARGS = ("max_length_q", "max_length_k")


@dataclass
class PackedDocuments:
    """Where the documents of packed rows go in a padded batch of documents (one a row, padded on the right).

    Tokens are numbered in the packed rows' flat (B * L) order; T real tokens in D documents of at most `longest`.
    """

    batch_shape: tuple  # (B, L) the packed rows
    num_documents: int  # D
    longest: int  # Lmax: the longest document
    packed_index: torch.Tensor  # (T,) each real token's index in the packed rows' flat (B * L) positions
    document_index: torch.Tensor  # (T,) the same token's index in the documents' flat (D * Lmax) positions
    attention_mask: torch.Tensor  # (D, Lmax) the documents' real tokens
    starts: torch.Tensor  # (B, L) True at each document's first token (packed layout)

    def to_documents(self, packed: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        """(B, ..., L, ...) packed rows, tokens at `token_dim` -> the same as documents (D, ..., Lmax, ...); zeros at
        the documents' padding."""
        moved = packed.movedim(token_dim, 1).flatten(0, 1)  # (B * L, ...)
        flat = moved.new_zeros(self.num_documents * self.longest, *moved.shape[1:])
        flat = flat.index_copy(0, self.document_index, moved[self.packed_index])
        return flat.unflatten(0, (self.num_documents, self.longest)).movedim(1, token_dim)

    def to_packed(self, documents: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        """(D, ..., Lmax, ...) documents, tokens at `token_dim` -> the packed rows (B, ..., L, ...); zeros at the
        packed rows' padding."""
        moved = documents.movedim(token_dim, 1).flatten(0, 1)  # (D * Lmax, ...)
        flat = moved.new_zeros(self.batch_shape[0] * self.batch_shape[1], *moved.shape[1:])
        flat = flat.index_copy(0, self.packed_index, moved[self.document_index])
        return flat.unflatten(0, self.batch_shape).movedim(1, token_dim)

    def next_token_starts(self) -> torch.Tensor:
        """(B, L) True where the next token starts a document: a next-token loss must not score that token there."""
        return F.pad(self.starts[:, 1:], (0, 1), value=False)


def boundary_signals(kwargs: dict) -> dict:
    """The boundary markers among a call's keyword arguments (those given, not None)."""
    signals = {}
    for name in BOUNDARY_KWARGS:  # (a loop, not a comprehension: every call of a model asks)
        if kwargs.get(name) is not None:
            signals[name] = kwargs[name]
    return signals


def without_boundaries(kwargs: dict) -> dict:
    """A call's keyword arguments without the boundary markers, for the pass over the regrouped documents."""
    return {name: value for name, value in kwargs.items() if name not in BOUNDARY_KWARGS + DESCRIPTIVE_KWARGS}


def find_packed_documents(batch_shape: tuple, attention_mask, device, kwargs: dict) -> PackedDocuments | None:
    """The documents of packed rows (`PackedDocuments`), or None where every row holds one document at most: no
    boundary marker given (nothing read), or markers that mark no boundary after a row's first token (one host read).

    A document starts at a row's first real token and at every real token where a marker says so: a position that
    does not follow the one of the real token before it (`position_ids`: a restart; positions may count the padding
    between the two tokens or not), a new `seq_idx`, or an offset in `cu_seq_lens_*`. Markers that disagree with the
    inputs' shape, or with each other (several given that mark different documents), are refused before any work."""
    signals = boundary_signals(kwargs)
    if not signals:
        return None
    batch_size, length = batch_shape
    if torch.compiler.is_exporting():
        raise NotImplementedError(
            f"An exported RAN reads one text per row; it cannot find the documents of a packed row "
            f"({', '.join(signals)}). Export without them, and pass documents as rows of a padded batch."
        )
    real = torch.ones(batch_shape, dtype=torch.bool, device=device)
    if attention_mask is not None:
        real = attention_mask.to(device).bool()
    # The real token before each position in its row (-1: none), so that padding holes do not count as boundaries.
    at = torch.arange(length, device=device).expand(batch_size, length)
    before = F.pad(torch.where(real, at, -1).cummax(1).values[:, :-1], (1, 0), value=-1)  # (B, L)
    first = real & (before < 0)  # every row's first real token
    marked = {}  # each marker's document starts (B, L)
    checks = []  # (problem, flag, offsets to show or None), read with the sizes: a False flag names a bad marker
    for name in ("position_ids", "seq_idx"):
        if name in signals:
            values = per_token_marker(signals[name], name, batch_shape).to(device)
            previous = values.gather(1, before.clamp(min=0))
            if name == "position_ids":  # the next position, or the next but for the padding in between
                continues = (values == previous + 1) | (values == previous + at - before)
            else:
                continues = values == previous
            marked[name] = first | (real & ~continues)
    lengths_names = [name for name in ("cu_seq_lens_q", "cu_seq_lens_k") if name in signals]
    if lengths_names:
        offsets = [cumulative_lengths(signals[name], name, batch_shape).to(device) for name in lengths_names]
        if len(offsets) == 2:
            if offsets[0].shape != offsets[1].shape:
                raise ValueError(
                    f"`cu_seq_lens_q` {tuple(offsets[0].shape)} and `cu_seq_lens_k` {tuple(offsets[1].shape)} differ: "
                    "a RAN reads every document's tokens as both queries and keys; pass the same offsets."
                )
            checks.append(("`cu_seq_lens_q` and `cu_seq_lens_k` differ", (offsets[0] == offsets[1]).all(), offsets[0]))
        offsets = offsets[0].long()
        name = lengths_names[0]
        checks.append((f"`{name}` must start at 0", offsets[0] == 0, offsets))
        checks.append((f"`{name}` must end at the row's length, {length}", offsets[-1] == length, offsets))
        checks.append((f"`{name}` must increase (no empty document)", (offsets.diff() > 0).all(), offsets))
        checks.append(("`cu_seq_lens_*` cover every position: no padding may be masked", real.all(), offsets))
        at_offset = torch.zeros(length, dtype=torch.bool, device=device)
        at_offset[offsets[:-1].clamp(0, length - 1)] = True
        marked[lengths_names[0]] = first | (real & at_offset[None])
    names = list(marked)
    starts = marked[names[0]]
    for name in names[1:]:
        checks.append(
            (
                f"`{names[0]}` and `{name}` mark different documents: give the markers of one packing (as "
                "`DataCollatorWithFlattening` does), or one of them",
                (starts == marked[name]).all(),
                None,
            )
        )
    document = torch.cumsum(starts.flatten(), 0) - 1  # (B * L,) the document of each position
    num_documents = starts.sum()
    document_lengths = torch.zeros(batch_size * length + 1, dtype=torch.long, device=device)
    document_lengths = document_lengths.index_add_(0, document.clamp(min=0), real.flatten().long())
    one_a_row = num_documents == real.any(1).sum()
    read = [one_a_row, num_documents, document_lengths.max(), real.sum()] + [flag for _, flag, _ in checks]
    found = torch.stack([value.long() for value in read]).tolist()  # the one host read
    for (problem, _, shown), ok in zip(checks, found[4:]):
        if not ok:  # the offsets are read again only to name them
            raise ValueError(f"Packed documents: {problem}{'' if shown is None else f' (got {shown.tolist()})'}.")
    if found[0]:
        return None  # every row one document (or none): the ordinary path is already exact
    num_documents, longest, num_tokens = found[1:4]
    packed_index = true_positions(real.flatten(), num_tokens)  # (T,)
    token_document = document[packed_index]  # (T,)
    offset = torch.arange(num_tokens, device=device) - group_starts(document_lengths[:num_documents])[token_document]
    document_index = token_document * longest + offset  # (T,)
    document_mask = torch.zeros(num_documents * longest, dtype=torch.bool, device=device)
    document_mask[document_index] = True
    return PackedDocuments(
        batch_shape=tuple(batch_shape),
        num_documents=num_documents,
        longest=longest,
        packed_index=packed_index,
        document_index=document_index,
        attention_mask=document_mask.view(num_documents, longest),
        starts=starts,
    )


def per_token_marker(values, name: str, batch_shape: tuple) -> torch.Tensor:
    """`position_ids` or `seq_idx` as a (B, L) integer tensor, or a clear error."""
    if not torch.is_tensor(values) or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"`{name}` must be an integer tensor of shape {batch_shape}, got {values!r:.60}.")
    if values.dim() == 1:
        values = values[None]
    if tuple(values.shape) != tuple(batch_shape):
        if values.dim() == 2 and values.shape[0] == 1 and values.shape[1] == batch_shape[1]:
            return values.expand(batch_shape)  # the same positions for every row, as Transformers allows
        raise ValueError(
            f"`{name}` has shape {tuple(values.shape)}, but the inputs have shape {tuple(batch_shape)}: give one "
            "per token (a packed row's restart where each document starts)."
        )
    return values


def cumulative_lengths(values, name: str, batch_shape: tuple) -> torch.Tensor:
    """`cu_seq_lens_*` as a 1-D integer tensor of the documents' offsets in one packed row, or a clear error."""
    if not torch.is_tensor(values):
        values = torch.as_tensor(values)
    if values.dim() != 1 or values.numel() < 2 or values.is_floating_point():
        raise ValueError(
            f"`{name}` must be the 1-D integer offsets of the documents in a packed row (0, then each document's "
            f"end), got shape {tuple(values.shape)}."
        )
    if batch_shape[0] != 1:
        raise ValueError(
            f"`{name}` gives the offsets of documents packed in one row, but the inputs have {batch_shape[0]} rows: "
            "pack them into one row (`DataCollatorWithFlattening` does), or pass restarting `position_ids` per row."
        )
    return values


def documents_apart(forward):
    """A call whose rows pack several documents (`position_ids` that restart, `seq_idx`, `cu_seq_lens_*`: what
    `DataCollatorWithFlattening` passes) reads each document as if it were alone (the module's docstring): the
    documents are regrouped into a padded batch, one a row, the ordinary forward runs over it, and the per-token
    outputs go back to the packed layout. A head that needs the documents first (for its labels) finds them and
    passes them as `packed_documents`. Any other call goes on as it is, and pays nothing unless it passes a marker."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        documents = kwargs.pop("packed_documents", None)
        if documents is None and not args:
            documents = packed_documents_of(self, kwargs)
        if documents is None:
            return forward(self, *args, **kwargs)
        check_packable(kwargs)
        kwargs = without_boundaries(kwargs)
        for name in ("input_ids", "inputs_embeds", "token_type_ids"):
            if kwargs.get(name) is not None:
                kwargs[name] = documents.to_documents(kwargs[name])
        kwargs["attention_mask"] = documents.attention_mask
        kwargs["use_cache"] = False  # (the config may ask for a cache; a packed row cannot carry one)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        outputs = outputs_to_packed(forward(self, **kwargs, return_dict=True), documents)
        return outputs if return_dict is not False else outputs.to_tuple()

    return wrapper


def packed_documents_of(model, kwargs: dict) -> PackedDocuments | None:
    """The documents of the packed rows of a call with `kwargs` (`find_packed_documents`), or None."""
    shape = input_batch_shape(kwargs.get("input_ids"), kwargs.get("inputs_embeds"), model.config.hidden_size)
    device = (kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).device
    return find_packed_documents(shape, kwargs.get("attention_mask"), device, kwargs)


def check_packable(kwargs: dict) -> None:
    """Refuse, before any work, what a packed row cannot read exactly: a cache (one recurrent state per row, while a
    row holds several documents) and a starting cell (one per row)."""
    problems = []
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        problems.append(
            "a cache (`past_key_values`/`use_cache=True`) carries one text per row: pass `use_cache=False` to train "
            "on packed rows, and generate from documents as rows of a padded batch"
        )
    if kwargs.get("initial_cell") is not None:
        problems.append(
            "`initial_cell` gives one starting cell per row: pass the documents as rows of a padded batch, each with "
            "its cell"
        )
    if problems:
        raise ValueError(
            "These inputs pack several documents in a row (`position_ids` that restart, `seq_idx` or `cu_seq_lens_*`), "
            f"which RAN reads one by one; but {'; and '.join(problems)}."
        )


def outputs_to_packed(outputs: RANModelOutput, documents: PackedDocuments) -> RANModelOutput:
    """`outputs` of the regrouped documents with every per-token output back in the packed layout: the token states,
    the recorded hidden states and attention weights. The cells and pooled outputs keep one row per document."""
    outputs.last_hidden_state = documents.to_packed(outputs.last_hidden_state)
    if outputs.hidden_states is not None:
        outputs.hidden_states = tuple(
            None if states is None else documents.to_packed(states) for states in outputs.hidden_states
        )
    if outputs.attentions is not None:  # (B, H, L, S): tokens at dim 2
        outputs.attentions = tuple(documents.to_packed(weights, token_dim=2) for weights in outputs.attentions)
    if outputs.memory_attentions is not None:  # (B, L, N)
        outputs.memory_attentions = tuple(documents.to_packed(weights) for weights in outputs.memory_attentions)
    return outputs
