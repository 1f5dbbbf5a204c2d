"""The causal baselines of the memory benchmarks (scripts/benchmarks/causal_baselines.py): the small gated linear
attention's chunked form is its recurrence, every model is causal, and the three are of matched size."""

import pytest
import torch
from causal_baselines import GatedLinearAttention, causal_baseline


def recurrent_gla(layer: GatedLinearAttention, x: torch.Tensor) -> torch.Tensor:
    """The recurrence itself, token by token: S_t = diag(a_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t."""
    batch, length, hidden = x.shape
    heads, head_dim = layer.num_heads, layer.head_dim
    query, key, value = (part.view(batch, length, heads, head_dim) for part in layer.qkv(x).chunk(3, dim=-1))
    decay = layer.log_decay(x).view(batch, length, heads, head_dim)
    state = x.new_zeros(batch, heads, head_dim, head_dim)
    outputs = []
    for t in range(length):
        state = decay[:, t].exp()[..., None] * state + key[:, t, :, :, None] * value[:, t, :, None, :]
        outputs.append(torch.einsum("bhd,bhde->bhe", query[:, t] * head_dim**-0.5, state))
    attended = layer.norm(torch.stack(outputs, dim=1)).reshape(batch, length, hidden)
    return layer.out(attended * torch.nn.functional.silu(layer.output_gate(x)))


@pytest.mark.parametrize("length", [11, 40], ids=["one-chunk", "chunks-and-a-partial-one"])
def test_gated_linear_attention_in_chunks_is_its_recurrence(length):
    torch.manual_seed(0)
    layer = GatedLinearAttention(hidden_size=16, num_heads=2)
    with torch.no_grad():  # gates from near 1 to the floor of the decay
        layer.gate[1].bias.copy_(torch.linspace(-40.0, 4.0, 16))
    x = torch.randn(3, length, 16)
    assert torch.allclose(layer(x), recurrent_gla(layer, x), atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mamba2", "gla"])
def test_baselines_are_causal(name):
    torch.manual_seed(0)
    model = causal_baseline(name, vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, context=20).eval()
    ids = torch.randint(0, 50, (2, 20))
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 50
    with torch.no_grad():
        assert torch.allclose(model(ids).logits[:, :12], model(changed).logits[:, :12], atol=1e-5)
        assert not torch.allclose(model(ids).logits[:, 12:], model(changed).logits[:, 12:])


def test_baselines_have_matched_sizes_and_unknown_names_fail():
    sizes = {
        name: sum(p.numel() for n, p in causal_baseline(name, 193, 64, 2, 4, 64).named_parameters()
                  if "emb" not in n and "wte" not in n and "wpe" not in n and "lm_head" not in n)
        for name in ("gpt2", "llama", "gla")
    }  # fmt: skip
    assert max(sizes.values()) < 1.25 * min(sizes.values()), sizes
    with pytest.raises(ValueError, match="no causal baseline 'mamba'"):
        causal_baseline("mamba", 193, 64, 2, 4, 64)
