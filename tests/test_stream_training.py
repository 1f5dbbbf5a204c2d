"""Training a causal RAN on streams longer than memory: chunks carry the recurrent state, backpropagation stops at
chunk boundaries (`RANCache.detach`, `lm_data.interleave_streams`, `run_clm.py --stream_training`)."""

import json

import numpy as np
import pytest
import run_clm
import torch
from benchmark_utils import LiveTensorPeak
from lm_data import interleave_streams
from test_scripts import QUIET, from_scratch, tokenizer_dir, topic_files  # noqa: F401 (fixtures)
from transformers import AutoTokenizer

from ran_hf import RANForCausalLM
from ran_hf.memory_review import RANMemoryReview


def test_streams_are_interleaved_so_each_row_continues_itself():
    rows = interleave_streams(np.arange(20), num_streams=2, chunk_size=3)["input_ids"]
    assert rows == [[0, 1, 2], [9, 10, 11], [3, 4, 5], [12, 13, 14], [6, 7, 8], [15, 16, 17]]


def test_a_detached_cache_keeps_its_state_and_cuts_the_graph(make_config):
    torch.manual_seed(0)
    model = RANForCausalLM(make_config())
    ids = torch.randint(1, 64, (2, 24))
    first = model(ids[:, :12], use_cache=True)
    cache = first.past_key_values
    before = {i: {name: t.clone() for name, t in layer.tensors().items()} for i, layer in enumerate(cache.layers)}
    assert any(t.requires_grad for layer in cache.layers for t in layer.tensors().values())
    assert cache.detach() is cache
    for i, layer in enumerate(cache.layers):
        for name, tensor in layer.tensors().items():
            assert not tensor.requires_grad
            assert torch.equal(tensor, before[i][name])
    # The next chunk reads the carried state, and its backward pass stops at the chunk boundary.
    second = model(ids[:, 12:], labels=ids[:, 12:], past_key_values=cache, use_cache=True)
    second.loss.backward()
    reference = model(ids, use_cache=False).logits[:, 12:]
    torch.testing.assert_close(second.logits, reference, atol=1e-5, rtol=1e-5)


def test_stream_training_memory_does_not_grow_with_the_stream(make_config, monkeypatch):
    """Twenty-four chunks in, a training step holds what it held at the fourth, plus a few copies of the carried cells.

    The cells are the only state that grows (2 D per window per layer, by design: memory review reads every earlier
    window); memory review's scores stay within `max_chunk_scores` however many cells there are. Counted exactly, as
    the bytes of live tensors. Without the chunk bound the step's peak grows by 6x the cells' growth here.
    """
    monkeypatch.setattr(RANMemoryReview, "max_chunk_scores", 2048)
    torch.manual_seed(0)
    model = RANForCausalLM(make_config(window_size=16)).train()
    cache, peaks, cell_bytes = None, [], []
    with LiveTensorPeak() as memory:
        for _ in range(24):
            memory.reset_peak()
            ids = torch.randint(1, 64, (2, 64))
            outputs = model(ids, labels=ids, past_key_values=cache, use_cache=True)
            outputs.loss.backward()
            model.zero_grad(set_to_none=True)
            cache = outputs.past_key_values.detach()
            del outputs
            peaks.append(memory.peak_bytes)
            cell_bytes.append(sum(layer.cell_states.nbytes for layer in cache.layers))
    assert cell_bytes[-1] > 5 * cell_bytes[3]  # the stream really accumulated cells
    assert peaks[-1] - peaks[3] <= 3 * (cell_bytes[-1] - cell_bytes[3])


@pytest.mark.slow
def test_run_clm_trains_on_streams_and_its_loss_goes_down(topic_files, tokenizer_dir, tmp_path):  # noqa: F811
    output_dir = tmp_path / "streams"
    results = run_clm.main(
        from_scratch(tokenizer_dir, output_dir)
        + ["--train_file", str(topic_files["train"]), "--validation_split_percentage", "0", "--stream_training"]
        + ["--block_size", "24", "--per_device_train_batch_size", "2", "--do_train", "--num_train_epochs", "3"]
        + ["--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "0"]
        + QUIET
    )
    assert results["train"]["train_samples"] % 2 == 0
    losses = [entry["loss"] for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]  # fmt: skip
    # Below the loss of the best predictor that ignores the context: each token's frequency in the training text
    # (its unigram entropy), which a model learning token counts alone would reach. Lower needs the context.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = [json.loads(line)["text"] for line in topic_files["train"].read_text().splitlines()]
    counts = np.bincount(np.concatenate([tokenizer(text)["input_ids"] for text in texts]))
    frequencies = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(frequencies * np.log(frequencies)).sum())
    tenth = max(len(losses) // 10, 1)
    assert np.mean(losses[-tenth:]) < unigram_entropy, (np.mean(losses[-tenth:]), unigram_entropy)
    assert "parallel streams" in (output_dir / "README.md").read_text()


def test_the_stream_trainer_carries_the_state_within_an_epoch_only(make_config, tmp_path):
    from transformers import TrainingArguments

    model = RANForCausalLM(make_config()).train()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2)
    trainer = run_clm.StreamTrainer(model=model, args=args, chunks_per_stream=2)
    ids = torch.randint(1, 64, (2, 12))
    carried = []
    for _ in range(3):  # chunk 1 and 2 of an epoch, then chunk 1 of the next
        trainer.compute_loss(model, {"input_ids": ids, "labels": ids}).backward()
        carried.append(trainer.stream_cache.lengths.tolist())
    assert carried == [[12, 12], [24, 24], [12, 12]]
