"""Small helpers shared by the test files: tiny configs and models whose every weight is random."""

import torch
from huggingface_hub.errors import StrictDataclassError

from ran_hf import RANConfig


# What a config refuses a value with: `@strict`'s errors (a field's type or range, a rule between fields), or a
# `ValueError` (a misspelt field's name, a model's edit).
CONFIG_ERROR = (ValueError, StrictDataclassError)


def tiny_config(**overrides) -> RANConfig:
    """A small RAN with several windows in short sequences and no dropout, so outputs are deterministic."""
    values = {
        "vocab_size": 61,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 8,
        "window_size": 5,
        "min_window_size": 2,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    values.update(overrides)
    return RANConfig(**values)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Give every parameter (biases, norm scales and shifts, initial cells included) a random value.

    Zero biases and unit norm scales hide mistakes (a swapped bias is invisible when it is zero), so equivalence
    tests run on weights where every term matters.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator) * scale
        if name.endswith("norm.weight"):
            parameter.copy_(1.0 + noise)
        else:
            parameter.copy_(noise)
    return model.eval()


def random_ids(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Token ids in [1, vocab_size): never the pad id."""
    return torch.randint(1, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def pad_batch(sequences, pad_id: int = 0, side: str = "right"):
    """Stack 1-D id tensors into (B, L) ids and attention mask, padded on `side`."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        span = slice(0, len(sequence)) if side == "right" else slice(length - len(sequence), length)
        ids[row, span], mask[row, span] = sequence, 1
    return ids, mask


def real_positions(mask_row: torch.Tensor) -> torch.Tensor:
    return mask_row.bool().nonzero().squeeze(-1)
