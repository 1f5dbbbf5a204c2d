"""`config.training_window_sizes`: a training pass reads its windows at a size drawn from the list, exactly as a model
built with that window size would; inference, a carried cache and an encoder's evaluation keep the config's."""

import pytest
import torch
from ran_testing import CONFIG_ERROR, randomize_, tiny_config

from ran_hf import RANConfig, RANForCausalLM, RANForSequenceClassification


def logits_at(model, ids, window_size):
    """The same weights read with another `window_size` (no dropout: training mode computes as inference)."""
    other = type(model)(model.config.__class__(**{**model.config.to_dict(), "training_window_sizes": [window_size],
                                                  "window_size": window_size}))  # fmt: skip
    other.load_state_dict(model.state_dict())
    return other.train()(ids).logits


@pytest.mark.parametrize("head", [RANForCausalLM, RANForSequenceClassification])
def test_a_training_pass_reads_at_a_drawn_window_size(head):
    config = tiny_config(is_causal=head is RANForCausalLM, training_window_sizes=[3, 4, 7])
    model = randomize_(head(config)).train()
    ids = torch.randint(1, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    expected = {size: logits_at(model, ids, size) for size in (3, 4, 7)}
    assert not torch.allclose(expected[3], expected[7])  # the window size shows in the outputs
    drawn = set()
    for seed in range(12):
        torch.manual_seed(seed)
        logits = model(ids).logits
        size = next(size for size, there in expected.items() if torch.allclose(logits, there, atol=1e-6))
        drawn.add(size)
    assert drawn == {3, 4, 7}  # every size is drawn, none other
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits_at(model.train(), ids, 5).detach())


def test_a_carried_cache_keeps_the_configs_window():
    """Stream training carries a cache whose windows must keep one size: there the config's is read."""
    config = tiny_config(is_causal=True, training_window_sizes=[3])
    model = randomize_(RANForCausalLM(config)).train()
    ids = torch.randint(1, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    carried = model(ids, use_cache=True).logits
    torch.testing.assert_close(carried, logits_at(model, ids, 5))


@pytest.mark.parametrize("sizes", [[], [16], [2, 40]])
def test_sizes_a_window_cannot_have_are_refused(sizes):
    with pytest.raises(CONFIG_ERROR, match="`training_window_sizes` must be window sizes above `min_window_size`"):
        RANConfig(is_causal=True, training_window_sizes=sizes)


def test_the_causal_memory_trains_at_a_quarter_half_and_all_of_its_window_by_default():
    """The default causal RAN's associative memory is trained across windows (benchmarks/memory_tasks/README.md):
    its sizes follow the window fields and the memory, and a size given by hand is kept."""
    config = RANConfig(is_causal=True)
    assert config.training_window_sizes == [64, 128, 256]
    config.window_size = 128
    assert config.training_window_sizes == [32, 64, 128]
    config.min_window_size = 40  # a quarter of the window is no window
    assert config.training_window_sizes == [64, 128]
    config.associative_memory = False
    assert config.training_window_sizes is None
    assert RANConfig().training_window_sizes is None  # the encoder, and the paper's causal layer, read at the window
    assert RANConfig(is_causal=True, layer_design="official").training_window_sizes is None
    given = RANConfig(is_causal=True, training_window_sizes=[256])  # the window alone
    given.window_size = 512
    assert given.training_window_sizes == [256]


def test_a_saved_config_keeps_its_training_window_sizes(tmp_path):
    """A folder saved when None meant the window alone keeps reading there; `associative_memory=False` given to
    `from_pretrained` turns the sizes off with the memory; a folder saved now keeps the sizes it resolved."""
    model = RANForCausalLM(tiny_config(is_causal=True, associative_memory=True))
    model.save_pretrained(tmp_path)
    saved = RANForCausalLM.from_pretrained(tmp_path).config
    assert saved.training_window_sizes == model.config.training_window_sizes is not None
    assert RANForCausalLM.from_pretrained(tmp_path, associative_memory=False).config.training_window_sizes is None
    old = model.config.to_dict() | {"training_window_sizes": None}
    assert RANConfig.from_dict(old).training_window_sizes == [model.config.window_size]
