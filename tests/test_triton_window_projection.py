"""The Triton window projection (triton_window_projection.py) equals the layer's PyTorch phase 1
(`RANLayer.project_windows_reference`): the windows' queries, keys and values and the gradient of the token
projections, for the encoder (activated queries and keys, merged short windows, padding), windows with enrichment
tokens (a token in two slots), the causal learnable-memory layer (values activated only), a prefix LM and no rotary
embedding, with the keys and values written a second time for the attention (room for the read cell, which the
gradients of both reach); and whole models with it equal models without it. On a CPU the kernels run in Triton's
interpreter; on CUDA compiled."""

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, tiny_config

from ran_hf import RANForCausalLM, RANModel
from ran_hf.kernels import choice as kernel_choice
from ran_hf.kernels.choice import TRITON_AVAILABLE, choose
from ran_hf.ran_layer import RANLayer
from ran_hf.window_layout import RANWindowLayout


pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
triton_window_projection = pytest.importorskip("ran_hf.kernels.triton_ops.window_projection", reason="no Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "encoder-padding-merged-tail": ({}, [13, 6, 2]),
    "enrichment-overlap": ({"window_overlap": 3}, [14, 9]),
    "causal-learnable-memory": ({"is_causal": True, "window_overlap": 2, "associative_memory": False}, [12, 7]),
    "no-rotary": ({"use_rotary": False, "window_overlap": 1}, [11, 4]),
    "wide-heads-past-one-block": (
        {"hidden_size": 24, "num_attention_heads": 3, "head_dim": 2 * triton_window_projection.BLOCK_PAIRS // 3 + 2},
        [9, 5],
    ),
}


def use_kernel(monkeypatch, on: bool):
    monkeypatch.setitem(kernel_choice.FORCED, "window_projection", "triton" if on else "pytorch")


@pytest.mark.parametrize("overrides, lengths", CASES.values(), ids=CASES.keys())
def test_triton_window_projection_equals_the_pytorch_phase_one(overrides, lengths, monkeypatch):
    config = tiny_config(**overrides)
    layer = randomize_(RANLayer(config, layer_idx=0)).to(DEVICE)
    _, mask = pad_batch([random_ids(n, config.vocab_size, n) for n in lengths])
    layout = RANWindowLayout.from_attention_mask(mask.to(DEVICE), config)
    generator = torch.Generator().manual_seed(len(lengths))
    normed = torch.randn(sum(lengths), config.hidden_size, generator=generator).to(DEVICE)
    rotations = layout.rotary(layer.head_dim, config.rope_theta, normed.device) if config.use_rotary else None
    use_kernel(monkeypatch, True)

    def run(on):
        leaf = normed.clone().requires_grad_()
        layer.zero_grad()
        if on:
            query, key, value, *_, joined = layer.project_windows(leaf, layout, None)
        else:
            query, key, value, *_, joined = layer.project_windows_reference(leaf, layout, None, rotations)
        # The kernel's keys and values as the attention reads them, slots 1.. of (K, H, 1 + S, d) (slot 0 is the
        # read cell's, written later): in PyTorch ops, the same keys and values read again.
        joined = (
            (key, value) if joined is None else [part[:, :, 1:] for part in (joined.key_joined, joined.value_joined)]
        )
        outs = (query, key, value, *joined)
        probes = torch.Generator().manual_seed(1)  # the same probes both ways; empty slots and queries included
        total = sum((out * torch.randn(out.shape, generator=probes).to(DEVICE)).sum() for out in outs)
        total.backward()
        return outs, [leaf.grad, layer.qkv_proj.weight.grad, layer.qkv_proj.bias.grad]

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5)
    assert all(out.is_contiguous() for out in actual[:3])
    for got, want in zip(actual_grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-5 * max(1.0, want.abs().max().item()))


def test_token_slots_invert_the_window_slots():
    """Every new token fills its own slot and, with enrichment, one slot of the next window: the (T, 2) map names
    exactly the slots whose `window_slots` entry is the token."""
    config = tiny_config(window_overlap=3)
    _, mask = pad_batch([random_ids(n, config.vocab_size, n) for n in (14, 3, 9)])
    layout = RANWindowLayout.from_attention_mask(mask, config)
    token_slots = layout.token_slots()
    num_tokens, flat = token_slots.shape[0], layout.window_slots.flatten()
    for token in range(num_tokens):
        filled = sorted((flat == token).nonzero().flatten().tolist())
        assert sorted(s for s in token_slots[token].tolist() if s >= 0) == filled
        assert 1 <= len(filled) <= 2


@pytest.mark.parametrize(
    "model_class, overrides",
    [(RANModel, {"window_overlap": 2}), (RANForCausalLM, {"is_causal": True})],
    ids=["encoder", "causal"],
)
def test_models_with_the_triton_window_projection_equal_the_pytorch_ones(model_class, overrides, monkeypatch):
    config = tiny_config(**overrides)
    model = randomize_(model_class(config)).to(DEVICE).train()  # no dropout in tiny configs: deterministic
    ids, mask = pad_batch([random_ids(n, config.vocab_size, n) for n in (17, 8)])
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)

    def run(on):
        use_kernel(monkeypatch, on)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask)
        states = out.last_hidden_state if model_class is RANModel else out.logits
        (states * mask[..., None]).square().mean().backward()
        return states.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert torch.allclose(actual, expected, atol=1e-5)
    assert actual_grads.keys() == expected_grads.keys()
    for name, want in expected_grads.items():
        assert torch.allclose(actual_grads[name], want, atol=1e-5 * max(1.0, want.abs().max().item())), name


def test_the_triton_window_projection_runs_on_cuda_unless_switched_off(monkeypatch):
    """On CUDA (and meta, which stands in for it) for SiLU and a pass without a cache; not on the CPU, not for
    another activation, not when continuing cached tokens, not when switched off."""

    def applies(*args):
        return choose("window_projection", *args) == "triton"

    meta, cpu = torch.empty(3, 8, device="meta"), torch.empty(3, 8)
    assert applies(meta, "silu", False)
    assert not applies(cpu, "silu", False)
    assert not applies(meta, "gelu", False)
    assert not applies(meta, "silu", True)
    monkeypatch.setitem(kernel_choice.TRITON, "window_projection", False)
    assert not applies(meta, "silu", False)
