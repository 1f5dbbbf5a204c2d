"""A plain, per-window RAN written straight from ../shared/design/RAN_ARCHITECTURE.md.

It reads one unpadded sequence at a time, window after window, with explicit concatenations and full attention
matrices: slow and obvious on purpose. It shares nothing with `ran_hf` but the weights (read from the model's
parameters), so that the fast layer is checked against an independent statement of the maths.
"""

import math

import torch
import torch.nn.functional as F


def standard_norm(x, eps):
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def layer_norm(x, norm, eps):
    return norm.weight * standard_norm(x, eps) + norm.bias


def linear(x, module):
    return x @ module.weight.T + module.bias


def glu(x, module):
    size = module.proj.weight.shape[0] // 2
    weight, bias = module.proj.weight, module.proj.bias
    return (x @ weight[:size].T + bias[:size]) * torch.sigmoid(x @ weight[size:].T + bias[size:])


def rotate(x, positions, theta):
    """Interleaved rotary embedding of x (P, H, d) at integer positions (P,)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = positions[:, None].float() * freqs[None, :]  # (P, d / 2)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def window_bounds(n, window, min_window):
    """[(start, end)] of the windows of a sequence of n tokens, the short tail merged into the window before."""
    if n <= window:
        return [(0, n)]
    bounds = [(start, min(start + window, n)) for start in range(0, n, window)]
    if bounds[-1][1] - bounds[-1][0] < min_window:
        last = bounds.pop()
        bounds[-1] = (bounds[-1][0], last[1])
    return bounds


class AssociativeRecall:
    """The causal layer's associative memory, token by token: each of a window's own tokens writes its key (mixed
    with the keys before it in its window by the key convolution, unit length) to its value by the delta rule, after
    the decay, then reads the state with its unit-length query. One per layer, carried from window to window."""

    def __init__(self, memory):
        self.memory, self.state = memory, 0.0

    def __call__(self, q, k, v, x, enrichment):
        """q, k, v (w, H, d) of the window's tokens (no cell, before rotary), x (w, D) their normalised inputs; the
        first `enrichment` tokens were written by the window before. Returns the reads (w, H, d)."""
        memory = self.memory
        if memory.key_conv_width:  # tap j weighs the key j slots before, within the window
            k = sum(tap[:, 0] * F.pad(k, (0, 0, 0, 0, lag, 0))[: len(k)] for lag, tap in enumerate(memory.key_conv))
        k, q = F.normalize(k, dim=-1), F.normalize(q, dim=-1)
        betas = torch.sigmoid(linear(x, memory.write_strength))  # (w, H)
        if memory.decays:
            decays = torch.exp(-F.softplus(x @ memory.decay.weight.T + memory.decay_bias))
        reads = torch.zeros_like(q)
        for t in range(enrichment, len(k)):
            if memory.decays:
                self.state = decays[t][:, None, None] * self.state
            recalled = torch.einsum("hd,hde->he", k[t], self.state) if torch.is_tensor(self.state) else 0
            self.state = self.state + betas[t][:, None, None] * k[t][:, :, None] * (v[t] - recalled)[:, None, :]
            reads[t] = torch.einsum("hd,hde->he", q[t], self.state) * memory.read_scale[:, None]
        return reads


def window_attention(layer, cell, tokens, config, causal, recall=None, enrichment=0):
    """One window: the cell at position 0, tokens at 1..w. Returns (raw cell, token outputs, cell key, cell value).
    `recall`: the layer's `AssociativeRecall`, whose reads join the tokens' attended values."""
    eps, heads, d = config.layer_norm_eps, config.num_attention_heads, config.head_dim
    act = F.silu if config.hidden_act == "silu" else getattr(F, config.hidden_act)
    x = layer_norm(torch.cat([cell[None], tokens]), layer.input_norm, eps)  # (1 + w, D)
    q, k, v = linear(x, layer.qkv_proj).view(x.shape[0], 3, heads, d).unbind(1)
    if config.attention_qk_activation:
        q, k = act(q), act(k)
    v = act(v)
    recalled = None if recall is None else recall(q[1:], k[1:], v[1:], x[1:], enrichment)
    positions = torch.arange(x.shape[0])
    if config.use_rotary:
        q, k = rotate(q, positions, config.rope_theta), rotate(k, positions, config.rope_theta)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    if causal:
        allowed = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).tril()
        allowed[0] = True  # the cell is written after its window: it reads all of it
        scores = scores.masked_fill(~allowed, float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # (1 + w, H, d)
    if recalled is not None:
        attended[1:] = attended[1:] + recalled
    if config.cell_max_pool:  # the cell also reads a soft maximum of its tokens' values, feature by feature
        temperature = 0.03
        attended[0] = attended[0] + temperature * torch.logsumexp(v[1:] / temperature, dim=0)
    out = linear(attended.reshape(x.shape[0], heads * d), layer.o_proj)
    written = act(out[0]) if config.memory_value_activation else out[0]  # what the cell writes
    out = act(out)
    gated = out + glu(x, layer.attention_glu)
    if config.cell_input_residual:
        raw_cell = standard_norm(layer_norm(written + glu(x[0], layer.attention_glu), layer.attention_norm, eps), eps)
    else:  # the cell is what its attention read
        raw_cell = standard_norm(written, eps)
    if config.residual_stream:  # tokens pass through; the branch is added to them
        token_out = tokens + gated[1:]
    else:
        token_out = standard_norm(layer_norm(gated[1:], layer.attention_norm, eps), eps)
    return raw_cell, token_out, k[0], v[0]


def memory_review(layer, outputs, cells, token_windows, initial_cell, config, causal):
    eps = config.layer_norm_eps
    act = F.silu if config.hidden_act == "silu" else getattr(F, config.hidden_act)
    review = layer.memory_review
    sink = causal and config.review_initial_cell
    if sink:
        cells = torch.cat([initial_cell[None], cells])
    residual = config.residual_stream
    q_linear = linear(layer_norm(outputs, review.norm, eps) if residual else outputs, review.q_proj)
    k_linear, v_linear = linear(cells, review.kv_proj).chunk(2, -1)
    q = act(q_linear)
    v = act(v_linear) if config.memory_value_activation else v_linear
    if config.review_qk_norm:  # scaled cosine of the un-activated projections
        scores = F.normalize(q_linear, dim=-1) @ F.normalize(k_linear, dim=-1).T * math.sqrt(q.shape[-1])
    else:
        scores = q @ act(k_linear).T / math.sqrt(q.shape[-1])  # (n, m)
    if config.review_log_scaling:  # times log_scale * log(cells the token reads)
        readable = torch.full((q.shape[0], 1), float(cells.shape[0]))
        if causal:
            readable = (torch.tensor(token_windows, dtype=torch.float)[:, None] + int(sink)).clamp(min=1)
        scores = scores * review.log_scale * readable.log()
    if config.review_salience:  # every token's score of a cell includes its learned prior, salience . key
        keys = F.normalize(k_linear, dim=-1) if config.review_qk_norm else act(k_linear)
        scores = scores + keys @ review.salience
    probs = scores.softmax(-1)
    if causal:  # a token of window i reads the cells of windows < i (and the initial cell, if it may)
        windows = torch.tensor(token_windows)[:, None]
        allowed = torch.arange(cells.shape[0])[None, :] < windows + int(sink)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)  # window 0: reads nothing
    read = linear(probs @ v, review.o_proj)
    out = (act(read) if config.memory_value_activation else read) + glu(q, review.glu)
    return outputs + out if residual else layer_norm(out, review.norm, eps)


def reference_forward(model, input_ids):
    """Run `model` (a RANModel) on one unpadded sequence of token ids, window by window.

    Returns a dict with `last_hidden_state` (n, D), `cells` (m, D) raw cells of the last layer, `last_cell`,
    `pooled_cell`, `pooler_output` (if the model has a pooler), `hidden_states` (list, embeddings first).
    """
    config = model.config
    eps, window, overlap = config.layer_norm_eps, config.window_size, config.window_overlap
    causal = config.is_causal
    embeddings = model.embeddings.word_embeddings.weight[input_ids]
    hidden = layer_norm(embeddings, model.embeddings.norm, eps)
    if config.token_shift:  # each token also reads its predecessor's embedding (zeros before the first)
        previous = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
        hidden = hidden + linear(previous, model.embeddings.token_shift)
    # A causal model cannot know where the text ends, so its last window never merges into the one before.
    min_window = 1 if causal else config.min_window_size
    bounds = window_bounds(len(input_ids), window, min_window)
    token_windows = [i for i, (start, end) in enumerate(bounds) for _ in range(start, end)]
    hidden_states = [hidden]

    cell = model.layers[0].initial_cell
    for layer in model.layers:
        if causal:
            cell = layer.initial_cell
        initial_cell = cell
        outputs, raw_cells, previous_raw = [], [], None
        recall = AssociativeRecall(layer.associative_memory) if config.associative_memory else None
        for i, (start, end) in enumerate(bounds):
            enrichment = overlap if i > 0 else 0
            window = hidden[start - enrichment : end]
            raw, token_out, _, _ = window_attention(layer, cell, window, config, causal, recall, enrichment)
            outputs.append(token_out[enrichment:])
            raw_cells.append(raw)
            if previous_raw is None or not config.use_cell_residual:
                cell = raw
            else:
                scan = layer.cell_scan  # the cell's own GLU and norm
                cell = layer_norm(raw + glu(previous_raw, scan.cell_glu), scan.cell_norm, eps)
            previous_raw = raw
        outputs, raw_cells = torch.cat(outputs), torch.stack(raw_cells)
        if config.memory_review:
            hidden = memory_review(layer, outputs, raw_cells, token_windows, initial_cell, config, causal)
        elif config.residual_stream:
            hidden = outputs
        else:
            hidden = layer_norm(outputs, layer.output_norm, eps)
        hidden_states.append(hidden)
    if config.residual_stream:  # one norm after the last layer
        hidden = hidden_states[-1] = layer_norm(hidden, model.norm, eps)

    pooled = {"last": cell, "mean": raw_cells.mean(0), "max": raw_cells.amax(0)}[config.cell_pooling]
    result = {
        "last_hidden_state": hidden,
        "cells": raw_cells,
        "last_cell": cell,
        "pooled_cell": pooled,
        "hidden_states": hidden_states,
    }
    if model.pooler is not None:
        act = F.silu if config.hidden_act == "silu" else getattr(F, config.hidden_act)
        pooler = model.pooler
        document = glu(act(linear(pooled, pooler.cell_dense)), pooler.cell_glu)
        tokens = hidden.amax(0) if config.token_pooling == "max" else hidden.mean(0)
        result["pooler_output"] = document + linear(tokens, pooler.token_dense)
    return result
