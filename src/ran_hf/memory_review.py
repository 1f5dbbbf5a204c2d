"""Memory review: every token attends over the cells its sequence's windows wrote (`RANMemoryReview`); which cells
each token may read is the layer's memory bookkeeping (causal_memory.py)."""

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .building_blocks import NormAfter, RANCenteredRMSNorm, RANGatedLinearUnit, activation_function, unit_vectors
from .cache_ran import RANCacheLayer
from .causal_memory import memory_to_read, remember
from .configuration_ran import RANConfig
from .decode_step import StepPositions
from .window_layout import RANWindowLayout


class RANMemoryReview(nn.Module):
    """Single-head attention of every token over the cells of its sequence's windows, with a gated residual.

    Official layer: LayerNorm(review + GLU(query)). With `config.residual_stream`, the norm comes first and the
    token states pass through: states + review + GLU(query), queries read from LayerNorm(states). With
    `config.review_qk_norm`, a cell's score is the scaled cosine of the un-activated query and key projections;
    without `config.memory_value_activation`, values and output projection are not activated.

    Tokens are reviewed in chunks: their scores over the cells form a (tokens x windows) matrix, which for a whole
    long document would grow with the square of its length.
    """

    # The most scores one chunk holds (batch x tokens x cells): 2^18, 1 MiB in float32. A chunk's working set then
    # stays the same however many cells a document or a carried stream has accumulated: 1,024 tokens of one
    # sequence against 256 cells, 67 against the 3,907 cells of a million-token document (windows of 256). With
    # 2^20, stream training's peak grew by 6% until the stream held 256 cells (benchmark_memory.py). A class
    # constant, not a config field: it trades speed for memory and never changes the outputs (beyond float
    # rounding), so checkpoints need not carry it.
    max_chunk_scores = 2**18
    # On CUDA: a chunk's float32 scores take at most 1/64 of the device's memory (1.25 GB, 312M scores on an 80 GB
    # card: 2 x 32K tokens against their 128 cells are one chunk); the softmax keeps a few such tensors at once.
    device_memory_share = 64

    def __init__(self, config: RANConfig):
        super().__init__()
        self.config = config
        hidden_size = config.hidden_size
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.kv_proj = nn.Linear(hidden_size, 2 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)
        self.glu = RANGatedLinearUnit(hidden_size)
        self.norm = RANCenteredRMSNorm(hidden_size, config.layer_norm_eps)
        self.act = activation_function(config.hidden_act)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob
        self.residual_stream = config.residual_stream
        self.qk_norm = config.review_qk_norm
        self.value_act = self.act if config.memory_value_activation else None  # None: none
        # Cell 0 is the starting cell, always in reach.
        self.reads_initial_cell = config.is_causal and config.review_initial_cell
        if config.review_salience:  # a learned prior of every cell, `salience . key`; zero at initialisation
            self.salience = nn.Parameter(torch.zeros(hidden_size))
        self.log_scaling = config.review_log_scaling  # scores times `log_scale` * log(cells read) (SSMax)
        if self.log_scaling:  # a softmax as sharp over the many cells of a long document as over training's few
            self.log_scale = nn.Parameter(torch.ones(()))
        # Cosine scores times sqrt(D) have the spread of ordinary attention scores at initialisation.
        self.scale = math.sqrt(hidden_size) if self.qk_norm else 1 / math.sqrt(hidden_size)

    def chunk_length(self, batch_size: int, num_cells: int, device: torch.device | None = None) -> int:
        """Tokens per chunk, so that a chunk holds at most `max_chunk_scores` scores; on a CUDA device at most
        1/`device_memory_share` of its memory in float32 scores (one chunk for every document that fits: each chunk
        is a few dozen kernel launches, and a GPU's memory is there to be used)."""
        budget = self.max_chunk_scores
        if device is not None and device.type == "cuda":
            memory = torch.cuda.get_device_properties(device).total_memory  # cached: no synchronisation
            budget = max(budget, memory // (4 * self.device_memory_share))
        return max(1, budget // max(1, batch_size * num_cells))

    def project_cells(self, cells: torch.Tensor) -> torch.Tensor:
        """(..., D) cells -> (..., 2 D) their keys and values; a cache keeps these, not the cells."""
        key, value = self.kv_proj(cells).chunk(2, dim=-1)
        key = unit_vectors(key) if self.qk_norm else self.act(key)
        return torch.cat([key, value if self.value_act is None else self.value_act(value)], dim=-1)

    def cell_salience(self, cell_states: torch.Tensor) -> torch.Tensor:
        """(..., 2 D) cell keys and values from `project_cells` -> (...) their learned prior, what every token's score
        of the cell includes (`config.review_salience`). In float32 even under autocast: its gradient sums over every
        token and cell, and cancels; in bfloat16 it was 1.9% off (the rest of the model: at most 1.2%)."""
        key = cell_states[..., : cell_states.shape[-1] // 2]
        with nullcontext() if key.is_meta else torch.autocast(key.device.type, enabled=False):
            dtype = torch.promote_types(key.dtype, torch.float32)  # (float64 stays so)
            return key.to(dtype) @ self.salience.to(dtype)

    def forward(self, token_states, raw_cells, initial_cell, layout: RANWindowLayout | StepPositions,
                cache: RANCacheLayer | None = None, output_attentions: bool = False):  # fmt: skip
        """The layer's memory review: token states (T, D) read the cells (N, B, D) of this pass's windows (and the
        cached ones) that they may (causal_memory.py); `initial_cell` (B or 1, D) is the layer's starting cell. Returns
        the reviewed token states (T, D) and, with `output_attentions`, the review weights (B, L, C) (zeros at
        padding); with a `cache`, it keeps the cells a later pass reads again (`causal_memory.remember`).

        A decoding step (`layout` is its `StepPositions`) hands one token per row, (B, D), and no cells of its own: it
        reads the cached ones (`step_cells`). Returns (B, D) and None."""
        if type(layout) is StepPositions:
            first_cell, cells, score_bias = self.step_cells(initial_cell, layout, cache)
            return self.read_cells(token_states, cells, score_bias, layout.reads_cells, first_cell)[0], None
        initial = self.project_cells(initial_cell) if self.reads_initial_cell else None
        cells = self.project_cells(raw_cells.transpose(0, 1))  # (B, N, 2 D): only this pass's cells
        (read_cells, readable_cells, first_readable, salient), memory = memory_to_read(
            self.config, self.cell_salience, cells, initial, layout, cache
        )
        # Ranges per token, (B, L), not a (B, L, C) mask: the review builds the mask one chunk of tokens at a time.
        real_tokens = None  # (B, L, 1): the review weights are none at padding
        if output_attentions:
            real_tokens = layout.to_padded(token_states.new_ones(layout.token_index.numel(), 1))
        reviewed, weights = self.review_tokens(
            layout.to_padded(token_states), read_cells, readable_cells, output_attentions, first_readable, salient,
            real_tokens,
        )  # fmt: skip
        if cache is not None:  # here, in the module's call: an offloaded salience is there only now
            remember(self.config, self.cell_salience, cache, layout, *memory)
        return layout.from_padded(reviewed), weights

    def step_cells(self, initial_cell, at: StepPositions, cache: RANCacheLayer):
        """What a decoding step's review reads: the starting cell's key and value (1, 2 D) where it reads it and a
        compiled step runs (else None), the cached cells' (B, C, 2 D), and every one's score bias (B, 1 + C) or
        (B, C) (`score_bias`). A compiled step rebuilds them every step and reads the starting cell apart: joined to
        the cached cells it would copy the whole room each time. Between eager steps they stay the same until a window
        ends (`cache.step_review`), so there the starting cell is joined to the cached ones once, and each step reads
        them all in one product."""
        compiling = at.compiled
        if cache.step_review is not None and not compiling:
            return cache.step_review
        cells = cache.cell_states
        if at.cells_read is not None:  # not the room's empty rest, which every token would score and hide again
            cells = cells[:, : at.cells_read]
        num_cells = cells.shape[1] + self.reads_initial_cell
        hidden = self.hidden_cells(num_cells, at.readable, at.first_readable)[0][:, 0]  # (B, C)
        first_cell = None
        if self.reads_initial_cell:
            first_cell = self.project_cells(initial_cell).to(cells.dtype)
        score_bias = self.score_bias(cells, hidden, first_cell)
        if compiling:
            return first_cell, cells, score_bias
        if first_cell is not None:
            cells = torch.cat([first_cell[None].expand(cells.shape[0], 1, -1), cells], dim=1)
        cache.step_review = None, cells, score_bias
        return cache.step_review

    def review_tokens(
        self,
        token_states: torch.Tensor,
        cell_states: torch.Tensor,
        readable_cells: torch.Tensor,
        output_attentions: bool = False,
        first_readable: torch.Tensor | None = None,
        salient: tuple[torch.Tensor, torch.Tensor] | None = None,
        real_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # token_states (B, L, D); cell_states (B, C, 2 D) from `project_cells`; readable_cells (B, L): each token
        # reads cells [0, readable_cells), or [first_readable, readable_cells) with a bounded memory
        # (`memory_review_cells`; the starting cell stays in reach). `salient`, with `memory_salient_cells`: a
        # (B, R, C) table of the further cells each of R reading windows may read, and (B, L) each token's row of
        # it. Returns the reviewed states (B, L, D) and, with `output_attentions`, the review weights (B, L, C),
        # which then exist whole, zero where `real_tokens` (B, L, 1) is: what `output_attentions=True` records as
        # `memory_attentions`.
        batch_size, length = token_states.shape[:2]
        # Compiled: one chunk, so that a new length or number of cells needs no new graph (memory O(tokens x cells)).
        num_cells = cell_states.shape[1]
        chunk_size = (
            length if torch.compiler.is_compiling() else self.chunk_length(batch_size, num_cells, token_states.device)
        )
        salient_table, salient_rows = (None, None) if salient is None else salient
        if length <= chunk_size:
            reviewed, weights = self.review_chunk(
                token_states, cell_states, readable_cells, first_readable, salient_table, salient_rows
            )
            return reviewed, (weights if real_tokens is None else weights * real_tokens) if output_attentions else None
        # With several chunks, each one's backward recomputes it (same dropout mask: checkpoint restores the RNG
        # state) so that training keeps (chunk x windows) probabilities for one chunk at a time, not for them all.
        # The tokens are split, not sliced: the backward of a split is one concatenation, where each slice's would
        # write a full-size zero gradient.
        recompute = torch.is_grad_enabled()
        num_chunks = -(-length // chunk_size)

        def split(tensor):
            return [None] * num_chunks if tensor is None else tensor.split(chunk_size, dim=1)

        reviewed, weights = [], []
        per_chunk = zip(*(split(tensor) for tensor in (token_states, readable_cells, first_readable, salient_rows)))
        for index, (tokens, readable, first, rows) in enumerate(per_chunk):
            inputs = (tokens, cell_states, readable, first, salient_table, rows)
            if recompute:
                states, probs = checkpoint(self.review_chunk, *inputs, use_reentrant=False)
                reviewed.append(states)
            else:  # written into one output as it comes: the chunks and their concatenation are not alive together
                states, probs = self.review_chunk(*inputs)
                if index == 0:
                    reviewed = states.new_empty(batch_size, length, states.shape[-1])
                reviewed[:, index * chunk_size : index * chunk_size + states.shape[1]] = states
            if output_attentions:  # kept only when asked for: all chunks' weights together are (tokens x cells)
                weights.append(probs)
        weights = torch.cat(weights, dim=1) if output_attentions else None
        if weights is not None and real_tokens is not None:
            weights = weights * real_tokens  # none at padding
        return torch.cat(reviewed, dim=1) if recompute else reviewed, weights

    def review_chunk(self, token_states, cell_states, *readable) -> torch.Tensor:
        """The review of a chunk of tokens and its weights, each token reading the cells `readable` gives it
        (`hidden_cells`' arguments)."""
        hidden, reads_any = self.hidden_cells(cell_states.shape[1], *readable)
        return self.read_cells(token_states, cell_states, self.score_bias(cell_states, hidden), reads_any)

    def read_cells(self, token_states, cell_states, score_bias, reads_any, first_cell=None):
        """`review_chunk` with what every score of a cell gets added given (`score_bias` (B, l, C)) and whether each
        token reads any cell ((B, l, 1) `reads_any`). A decoding step keeps the bias of its window's cells, and
        gives its tokens as (B, D), the bias as (B, C) and `reads_any` as (B, 1); a compiled one, the layer's starting
        cell's key and value apart (`first_cell` (1, 2 D), read before `cell_states`, its bias in column 0)."""
        if self.residual_stream:
            review, probs = self.review(self.norm(token_states), cell_states, score_bias, reads_any, None, first_cell)
            return token_states + review, probs
        return self.review(token_states, cell_states, score_bias, reads_any, self.norm, first_cell)

    def score_bias(self, cell_states, hidden, first_cell=None) -> torch.Tensor:
        """What each token's score of each cell gets added: -inf for the cells it may not read (`hidden` (B, l, C) or
        a decoding step's (B, C), with its `first_cell` in column 0), else the cell's learned salience
        (`config.review_salience`) or 0. In float32 where there is a salience."""
        if not hasattr(self, "salience"):
            return torch.where(hidden, float("-inf"), 0.0)  # in the scores' dtype when added (`review`)
        salience = self.cell_salience(cell_states)  # (B, C)
        if first_cell is not None:
            salience = torch.cat([self.cell_salience(first_cell).expand(salience.shape[0], 1), salience], dim=1)
        return torch.where(hidden, float("-inf"), salience if hidden.dim() == 2 else salience[:, None, :])

    def hidden_cells(self, num_cells, readable_cells, first_readable=None, salient_table=None, salient_rows=None):
        """Which of `num_cells` cells each token may not read, (B, l, C), and whether it reads any, (B, l, 1): cells
        [0, readable_cells) of its row, from `first_readable` on with a bounded memory (the starting cell stays in
        reach), and with `salient_table` (B, R, C) the salient ones of its row `salient_rows` too."""
        # A token that may read no cell (a causal first window, an all-padding row) gets no review; its row is
        # unmasked only to keep the softmax finite, then zeroed.
        readable = readable_cells[..., None] > 0  # (B, l, 1)
        limit = torch.where(readable, readable_cells[..., None], num_cells)  # (B, l, 1)
        cell_index = torch.arange(num_cells, device=readable_cells.device)
        hidden = cell_index >= limit  # (B, l, C): cells the token may not read
        if first_readable is not None:  # a bounded memory: older cells are out of reach
            hidden = hidden | ((cell_index < first_readable[..., None]) & (cell_index >= int(self.reads_initial_cell)))
        if salient_table is not None:  # ... but the salient ones among them are kept
            index = salient_rows[..., None].expand(-1, -1, salient_table.shape[-1])
            hidden = hidden & ~salient_table.gather(1, index)
        return hidden & readable, readable  # a token that reads nothing: nothing hidden, its softmax stays finite

    def review(self, token_states, cell_states, score_bias, reads_any, norm=None, first_cell=None):
        """The review of a chunk of tokens and its weights; `norm` (the official layer's) applied to it. A decoding
        step's `first_cell` (a compiled one's) is scored and read apart from `cell_states`: joining them would copy
        every cached cell each step."""
        projected = self.q_proj(token_states)  # (B, l, D)
        query = self.act(projected)
        key, value = cell_states.chunk(2, dim=-1)  # (B, C, D) each
        # Few keys (one per window) and many queries: plain matmuls beat fused attention kernels here, whose
        # CPU backward is tuned for long key sequences.
        scoring_query = unit_vectors(projected) if self.qk_norm else query
        one_token = token_states.dim() == 2  # (B, D): a decoding step's, one token per row, bias (B, C)
        if one_token:
            scores = torch.bmm(key, scoring_query[:, :, None])[..., 0]  # (B, C)
            if first_cell is not None:
                first_key, first_value = first_cell.chunk(2, dim=-1)  # (1, D) each
                scores = torch.cat([(scoring_query * first_key).sum(-1, keepdim=True), scores], dim=1)
            scores = scores * self.scale
        else:
            scores = (scoring_query @ key.transpose(1, 2)) * self.scale  # (B, l, C)
        if self.log_scaling:  # the cells a token reads are those its bias leaves finite
            cells_read = (score_bias != float("-inf")).sum(-1, keepdim=True).clamp(min=1)
            scores = scores * (self.log_scale * cells_read.to(scores.dtype).log())
        # With a salience, float32 from here on; without, in the scores' dtype (autocast's, where it is on).
        scores = scores + (score_bias if hasattr(self, "salience") else score_bias.to(scores.dtype))
        probs = torch.softmax(scores, dim=-1) * reads_any
        probs_read = F.dropout(probs, self.attention_dropout) if self.training else probs  # (no call in inference)
        probs_read = probs_read.to(value.dtype)
        if one_token and first_cell is not None:
            review = torch.bmm(probs_read[:, None, 1:], value)[:, 0] + probs_read[:, :1] * first_value  # (B, D)
        elif one_token:
            review = torch.bmm(probs_read[:, None], value)[:, 0]  # (B, D)
        else:
            review = probs_read @ value  # (B, l, D)
        # dropout(value_act(o_proj(review))) + GLU(query), then the norm: on CUDA all inside the GLU's kernel
        then = None if norm is None else NormAfter(norm)
        return self.glu(query, self.o_proj(review), self.value_act, self.dropout, then=then), probs
