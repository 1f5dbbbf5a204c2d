"""Causal language models to compare the causal RAN with, built at a matched size for the memory benchmarks.

    gpt2    Transformers' GPT-2: learned positions, full causal attention, GELU MLP of 4x width
    llama   Transformers' Llama: rotary positions, full causal attention, SwiGLU MLP of ~8/3x width (as many weights)
    mamba2  Transformers' Mamba-2 (its torch path on CPU): gated state-space blocks, no separate MLP
    gla     gated linear attention (Yang et al., ICML 2024), written small: a recurrent memory of one (d_k x d_v)
            matrix per head, decayed by a data-dependent gate per key dimension and written with k^T v each token,
            computed in chunks (the recurrence unrolled into a masked matrix product within a chunk, the state carried
            across), then a SwiGLU MLP

Every model takes `model(input_ids)` and returns an object with `.logits` (B, T, V), as the Transformers models do.
`causal_baseline(name, vocab_size, hidden_size, num_layers, num_heads, context)` builds one without dropout. Llama
also takes `head_dim` and `intermediate_size`, and Mamba-2 `expand`, so that a benchmark can match another model's
parameter count at the same width and depth (Mamba-2's heads are of size 64, its state 64 per head dimension).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM
from transformers.modeling_outputs import CausalLMOutput


GATE_RANK = 16  # the gate's low-rank projection, as in the paper
GATE_TEMPERATURE = 16.0  # log-decay divided by this: decays start close to 1, so memory lasts at initialisation
MIN_LOG_DECAY = -2.0  # per token: a chunk's decays then stay within float32 (e^(16 x 2)) in the chunked form
CHUNK = 16


class GatedLinearAttention(nn.Module):
    """S_t = diag(a_t) S_{t-1} + k_t^T v_t per head, o_t = q_t S_t, then a per-head norm, a SiLU output gate and
    the output projection. log a_t = max(logsigmoid(gate(x_t)) / 16, -2), per key dimension.

    Computed in chunks of 16 tokens (as flash-linear-attention's chunked GLA): within a chunk the recurrence as a
    masked matrix product, across chunks the state carried and decayed."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.gate = nn.Sequential(nn.Linear(hidden_size, GATE_RANK, bias=False), nn.Linear(GATE_RANK, hidden_size))
        self.output_gate = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(self.head_dim)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        return (F.logsigmoid(self.gate(x)) / GATE_TEMPERATURE).clamp(min=MIN_LOG_DECAY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        heads = (batch, length, self.num_heads, self.head_dim)
        query, key, value = (part.view(heads).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, d)
        query = query * self.head_dim**-0.5
        log_decay = self.log_decay(x).view(heads).transpose(1, 2)  # (B, H, T, d), <= 0
        state = x.new_zeros(batch, self.num_heads, self.head_dim, self.head_dim)
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
        outputs = []
        for start in range(0, length, CHUNK):
            q, k, v, g = (t[:, :, start : start + CHUNK] for t in (query, key, value, log_decay))
            total = g.cumsum(dim=2)  # G_t: the log-decay from the chunk's start to t
            decayed_query, grown_key = q * total.exp(), k * (-total).exp()
            size = q.shape[2]
            scores = (decayed_query @ grown_key.transpose(-1, -2)).masked_fill(~causal[:size, :size], 0.0)
            outputs.append(scores @ v + decayed_query @ state)  # within the chunk, and the state before it
            last = total[:, :, -1:]  # (B, H, 1, d)
            state = last.transpose(-1, -2).exp() * state + (k * (last - total).exp()).transpose(-1, -2) @ v
        attended = self.norm(torch.cat(outputs, dim=2)).transpose(1, 2).reshape(batch, length, -1)  # (B, T, D)
        return self.out(attended * F.silu(self.output_gate(x)))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * inner_size, bias=False)
        self.down = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class GLAForCausalLM(nn.Module):
    """Pre-norm blocks of gated linear attention and a SwiGLU MLP; tied embedding and output."""

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attention_norm": nn.RMSNorm(hidden_size),
                    "attention": GatedLinearAttention(hidden_size, num_heads),
                    "mlp_norm": nn.RMSNorm(hidden_size),
                    "mlp": SwiGLU(hidden_size, llama_inner_size(hidden_size)),
                }
            )
            for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden_size)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> CausalLMOutput:
        states = self.embed(input_ids)
        for block in self.blocks:
            states = states + block["attention"](block["attention_norm"](states))
            states = states + block["mlp"](block["mlp_norm"](states))
        return CausalLMOutput(logits=self.norm(states) @ self.embed.weight.T)


def llama_inner_size(hidden_size: int) -> int:
    """A SwiGLU width with the weights of a 4x GELU MLP: 2/3 of 4x, rounded up to a multiple of 4."""
    return -(-8 * hidden_size // 3 // 4) * 4


def matched_llama(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    context: int,
    *,
    head_dim: int,
    target: int,
    size,
) -> LlamaForCausalLM:
    """Llama with the given width, depth, heads and head size whose MLP width brings `size(model)` (a parameter count)
    closest to `target`: parameters are linear in the MLP width, so two builds solve for it."""

    def llama(inner: int) -> LlamaForCausalLM:
        sizes = (vocab_size, hidden_size, num_layers, num_heads, context)
        return causal_baseline("llama", *sizes, head_dim=head_dim, intermediate_size=inner)

    base, step = size(llama(64)), size(llama(128)) - size(llama(64))
    return llama(max(4, 64 + round((target - base) / step * 64)))


def causal_baseline(
    name: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    context: int,
    *,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    expand: int = 2,
    chunk_size: int = 64,
):
    """GPT-2, Llama, Mamba-2 or GLA of the given size, without dropout; `context` is the longest input a GPT-2 must
    take. Llama's `head_dim` (default hidden / heads) and `intermediate_size` (default `llama_inner_size`) and
    Mamba-2's `expand` (inner width / hidden; `num_heads` is then inner width / 64) size them to match another model.
    Mamba-2's `chunk_size` changes only how its scan is computed, not what: its torch path pads every sequence to a
    multiple of it, so 64 (not Transformers' 256) keeps short sequences from costing 256 tokens (10x on CPU at 64)."""
    if name == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_positions=context, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if name == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size,
            intermediate_size=intermediate_size or llama_inner_size(hidden_size), head_dim=head_dim,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
            max_position_embeddings=context, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
            pad_token_id=None,
        )  # fmt: skip
        return LlamaForCausalLM(config)
    if name == "mamba2":
        inner = expand * hidden_size
        if inner % 64:
            raise ValueError(f"Mamba-2's heads are of size 64: expand x hidden ({inner}) must be a multiple of 64")
        config = Mamba2Config(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_heads=inner // 64,
            head_dim=64, state_size=64, n_groups=1, expand=expand, chunk_size=chunk_size, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        return Mamba2ForCausalLM(config)
    if name == "gla":
        return GLAForCausalLM(vocab_size, hidden_size, num_layers, num_heads)
    raise ValueError(f"no causal baseline {name!r}: choose gpt2, llama, mamba2 or gla")
