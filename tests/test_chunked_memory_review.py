"""Memory review in chunks of tokens: the same outputs and gradients as one pass over all tokens.

`RANMemoryReview.chunk_length` bounds the (tokens x windows) scores a long document would otherwise hold at once;
in training each chunk is recomputed in the backward pass. Forcing a chunk of a few tokens here exercises every chunk
boundary (inside windows, across windows, across padding) on sequences the tiny configs cut into many windows.
"""

import weakref

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, real_positions, tiny_config

from ran_hf import RANForCausalLM, RANModel, memory_review
from ran_hf.memory_review import RANMemoryReview


TOLERANCE = 1e-5
WHOLE = 10**9  # a chunk longer than any test sequence: the unchunked review
CONFIGS = [
    pytest.param({}, id="encoder"),
    pytest.param({"window_overlap": 2, "cell_pooling": "mean"}, id="encoder-overlap"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"is_causal": True, "layer_design": "official"}, id="causal-official-layer"),
]


def review_in_chunks_of(chunk_size, monkeypatch):
    monkeypatch.setattr(RANMemoryReview, "chunk_length", lambda self, batch_size, num_cells, device=None: chunk_size)


def run(model, chunk_size, monkeypatch, *inputs, **kwargs):
    """Outputs and parameter gradients of one forward + backward pass with memory review in `chunk_size` chunks."""
    review_in_chunks_of(chunk_size, monkeypatch)
    model.zero_grad(set_to_none=True)
    outputs = model(*inputs, **kwargs)
    outputs.last_hidden_state.pow(2).sum().backward(retain_graph=outputs.pooler_output is not None)
    if outputs.pooler_output is not None:
        outputs.pooler_output.pow(2).sum().backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return outputs, gradients


def assert_close(actual, expected, what):
    """Within 1e-5, relative to the largest entry where that exceeds 1 (summed gradients reach ~10)."""
    diff = (actual - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    assert diff <= TOLERANCE * scale, f"{what}: max abs diff {diff:.2e} (largest entry {scale:.1f})"


@pytest.mark.parametrize("chunk_size", [1, 3, 7])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_chunked_review_equals_whole(overrides, side, chunk_size, monkeypatch):
    config = tiny_config(num_hidden_layers=2, **overrides)
    model = randomize_(RANModel(config), seed=1).train()  # train(): the chunks are recomputed in the backward pass
    sequences = [random_ids(n, config.vocab_size, seed=n) for n in (23, 9, 1, 16)]
    ids, mask = pad_batch(sequences, side=side)

    whole, whole_gradients = run(model, WHOLE, monkeypatch, ids, attention_mask=mask)
    chunked, chunked_gradients = run(model, chunk_size, monkeypatch, ids, attention_mask=mask)

    for row in range(len(sequences)):
        real = real_positions(mask[row])
        assert_close(chunked.last_hidden_state[row, real], whole.last_hidden_state[row, real], "token states")
    for field in ("pooler_output", "pooled_cell", "last_cell", "cells"):
        assert_close(getattr(chunked, field), getattr(whole, field), field)
    assert chunked_gradients.keys() == whole_gradients.keys()
    for name, gradient in whole_gradients.items():
        assert_close(chunked_gradients[name], gradient, f"gradient of {name}")


@pytest.mark.parametrize("overrides", CONFIGS[2:])
def test_chunked_review_continues_a_cache(overrides, monkeypatch):
    """A causal continuation reads cached cells; its logits and gradients do not depend on the chunk size."""
    model = randomize_(RANForCausalLM(tiny_config(**overrides)), seed=2).train()
    ids, mask = pad_batch([random_ids(n, model.config.vocab_size, seed=n) for n in (31, 20)], side="left")

    def continue_text(chunk_size):
        review_in_chunks_of(chunk_size, monkeypatch)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            cache = model(ids[:, :12], attention_mask=mask[:, :12], use_cache=True).past_key_values
        logits = model(ids[:, 12:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
        logits.pow(2).sum().backward()
        return logits, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    whole, whole_gradients = continue_text(WHOLE)
    chunked, chunked_gradients = continue_text(2)
    real = mask[:, 12:].bool()
    assert_close(chunked[real], whole[real], "logits")
    for name, gradient in whole_gradients.items():
        assert_close(chunked_gradients[name], gradient, f"gradient of {name}")


@pytest.mark.parametrize("overrides", [CONFIGS[0], CONFIGS[2]])
def test_recomputed_chunks_reuse_their_dropout(overrides, monkeypatch):
    """With dropout on, the backward pass recomputes each chunk with the dropout masks its forward pass drew."""
    config = tiny_config(attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.2, **overrides)
    model = randomize_(RANModel(config), seed=3).train()
    ids = random_ids(29, config.vocab_size, seed=5)[None]

    def gradients():
        torch.manual_seed(0)
        return run(model, 4, monkeypatch, ids)

    recomputed, recomputed_gradients = gradients()
    # The same chunks, kept whole for the backward pass instead of recomputed: the same RNG draws, in order.
    monkeypatch.setattr(memory_review, "checkpoint", lambda function, *args, **kwargs: function(*args))
    kept, kept_gradients = gradients()
    assert_close(recomputed.last_hidden_state, kept.last_hidden_state, "token states")
    for name, gradient in kept_gradients.items():
        assert_close(recomputed_gradients[name], gradient, f"gradient of {name}")


def test_chunk_weights_are_not_kept_unless_asked_for(monkeypatch):
    """Each chunk's review weights are (chunk x cells); kept for every chunk they would be (tokens x cells) again."""
    review_in_chunks_of(3, monkeypatch)
    review_chunk, alive, most_alive = RANMemoryReview.review_chunk, [], []

    def tracked(self, *inputs):
        # Reference counting frees a chunk's weights as soon as nothing holds them (no gc.collect(): a full collection
        # per chunk costs seconds in a process that holds a whole test session).
        most_alive.append(sum(ref() is not None for ref in alive))  # earlier chunks' weights still held
        states, probs = review_chunk(self, *inputs)
        alive.append(weakref.ref(probs))
        return states, probs

    monkeypatch.setattr(RANMemoryReview, "review_chunk", tracked)
    model = RANModel(tiny_config()).eval()
    ids = random_ids(40, model.config.vocab_size, seed=0)[None]
    with torch.no_grad():
        model(ids)
        assert len(alive) > 10 and max(most_alive) <= 1  # at most the chunk before, in a loop variable
        outputs = model(ids, output_attentions=True)  # asked for: every chunk's weights, then all layers'
    assert outputs.memory_attentions[0].shape[:2] == (1, 40)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_chunk_holds_at_most_its_share_of_scores(batch_size, monkeypatch):
    """However many cells the tokens read, one chunk scores at most `max_chunk_scores` (batch x tokens x cells)."""
    monkeypatch.setattr(RANMemoryReview, "max_chunk_scores", 60)
    review_chunk, scores_per_chunk = RANMemoryReview.review_chunk, []

    def counted(self, *inputs):
        states, probs = review_chunk(self, *inputs)
        scores_per_chunk.append(probs.numel())
        return states, probs

    monkeypatch.setattr(RANMemoryReview, "review_chunk", counted)
    model = RANModel(tiny_config(num_hidden_layers=1)).eval()
    for length in (12, 40, 90):
        scores_per_chunk.clear()
        with torch.no_grad():
            outputs = model(random_ids(length, model.config.vocab_size, seed=length)[None].repeat(batch_size, 1))
        num_cells = outputs.cells.shape[1]
        chunk_length = max(1, 60 // (batch_size * num_cells))
        assert len(scores_per_chunk) == -(-length // chunk_length)
        assert max(scores_per_chunk) <= max(60, batch_size * num_cells)  # a chunk has at least one token
    assert len(scores_per_chunk) > 10


def test_a_cuda_device_reviews_in_chunks_sized_for_its_memory(monkeypatch):
    """On CUDA a chunk may hold 1/64 of the device's memory in scores: one chunk for 2 x 32K tokens against their
    256 cells on an 80 GB card; the CPU budget stays 2^18 scores."""
    review = RANMemoryReview(tiny_config())
    properties = type("Properties", (), {"total_memory": 80 * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    assert review.chunk_length(2, 256, torch.device("cuda")) >= 32768
    assert review.chunk_length(2, 256, torch.device("cpu")) == 2**18 // 512
    assert review.chunk_length(2, 256) == 2**18 // 512


def test_chunks_are_split_not_sliced(monkeypatch):
    """The tokens reach the chunks through one `split` (its backward is one concatenation), not one slice each
    (each slice's backward writes a full-size zero gradient): more chunks, no more slice backwards."""
    model = randomize_(RANModel(tiny_config(num_hidden_layers=1)), seed=1).train()
    ids = random_ids(31, model.config.vocab_size, seed=3)[None]

    def slice_backwards(chunk_size):
        review_in_chunks_of(chunk_size, monkeypatch)
        ops = []

        class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func._schema.name)
                return func(*args, **(kwargs or {}))

        with Recorder():
            model(ids).last_hidden_state.pow(2).sum().backward()
        return ops.count("aten::slice_backward")

    assert slice_backwards(5) == slice_backwards(1000)
