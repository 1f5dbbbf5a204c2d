"""Packed documents (`DataCollatorWithFlattening`): a row that packs several documents, its boundaries given by
restarting `position_ids`, `cu_seq_lens_q`/`cu_seq_lens_k` or `seq_idx`, gives every head's outputs, losses and
gradients of its documents read alone; `Trainer` trains on such rows; what cannot be exact is refused before any
work."""

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, tiny_config
from torch.utils.data import Dataset
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from ran_hf import (
    RANForCausalLM,
    RANForMaskedLM,
    RANForPrefixLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)


TOLERANCE = 1e-5
# Documents of one token, shorter than a window (5), several windows long, with a short tail (merged in the encoder).
LENGTHS = [7, 1, 13, 3, 11]
CONFIGS = {
    "encoder": {},
    "encoder-overlap-mean": {"window_overlap": 2, "cell_pooling": "mean", "token_shift": True},
    "causal": {"is_causal": True},
    "causal-memory": {
        "is_causal": True,
        "window_overlap": 2,
        "token_shift": True,
        "associative_memory": True,
        "memory_review_cells": 2,
        "memory_salient_cells": 1,
    },
}
BOUNDARIES = ["position_ids", "cu_seq_lens", "seq_idx"]


def make_documents(vocab_size, lengths=LENGTHS, seed=0):
    return [random_ids(n, vocab_size, seed=100 * seed + i) for i, n in enumerate(lengths)]


def packed_inputs(documents, boundaries="position_ids"):
    """One row holding `documents`, with the markers `DataCollatorWithFlattening` gives."""
    inputs = {"input_ids": torch.cat(documents)[None]}
    if boundaries == "position_ids":
        inputs["position_ids"] = torch.cat([torch.arange(len(d)) for d in documents])[None]
    elif boundaries == "cu_seq_lens":
        offsets = torch.tensor([0] + [len(d) for d in documents]).cumsum(0).int()
        inputs |= {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": 13, "max_length_k": 13}
    else:
        inputs["seq_idx"] = torch.cat([torch.full((len(d),), i) for i, d in enumerate(documents)])[None].int()
    return inputs


def spans(documents):
    start = 0
    for document in documents:
        yield slice(start, start + len(document))
        start += len(document)


def assert_close(actual, expected, what, scale=1.0):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert diff <= TOLERANCE * scale, f"{what}: max abs diff {diff:.2e}"


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(model, loss_packed, loss_alone):
    model.zero_grad()
    loss_packed.backward()
    packed = gradients(model)
    model.zero_grad()
    loss_alone.backward()
    alone = gradients(model)
    assert packed.keys() == alone.keys()
    for name in alone:  # relative to the gradient's size where it exceeds 1: float32 sums in another order
        scale = max(1.0, alone[name].abs().max().item())
        assert_close(packed[name], alone[name], f"gradient of {name}", scale)


@pytest.mark.parametrize("boundaries", BOUNDARIES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_base_model_reads_each_document_alone(name, boundaries):
    config = tiny_config(**CONFIGS[name])
    model = randomize_(RANModel._from_config(config, attn_implementation="eager"), seed=1)
    documents = make_documents(config.vocab_size)
    packed = model(**packed_inputs(documents, boundaries), output_hidden_states=True, output_attentions=True)
    probe = torch.randn(packed.last_hidden_state.shape, generator=torch.Generator().manual_seed(0))
    loss_alone = 0.0
    for index, (document, tokens) in enumerate(zip(documents, spans(documents))):
        alone = model(document[None], output_hidden_states=True, output_attentions=True)
        assert_close(packed.last_hidden_state[:, tokens], alone.last_hidden_state, f"token states of {index}")
        for layer, (states, states_alone) in enumerate(zip(packed.hidden_states, alone.hidden_states)):
            assert_close(states[:, tokens], states_alone, f"hidden states {layer} of {index}")
        for layer, (weights, weights_alone) in enumerate(zip(packed.memory_attentions, alone.memory_attentions)):
            n = weights_alone.shape[-1]
            assert_close(weights[:, tokens, :n], weights_alone, f"memory attentions {layer} of {index}")
        for layer, (weights, weights_alone) in enumerate(zip(packed.attentions, alone.attentions)):
            n = weights_alone.shape[-1]
            assert_close(weights[:, :, tokens, :n], weights_alone, f"attentions {layer} of {index}")
        for field in ("pooler_output", "pooled_cell", "last_cell"):
            assert_close(packed[field][index : index + 1], alone[field], f"{field} of {index}")
        windows = alone.cells.shape[1]
        assert_close(packed.cells[index : index + 1, :windows], alone.cells, f"cells of {index}")
        loss_alone = loss_alone + (alone.last_hidden_state * probe[:, tokens]).sum() + alone.pooler_output.sum()
    loss_packed = (packed.last_hidden_state * probe).sum() + packed.pooler_output.sum()
    assert_same_gradients(model, loss_packed, loss_alone)


def test_rows_with_padding_and_restarts_read_each_document_alone():
    """Several packed rows, left-padded, each restarting its positions (a packer's rows rather than the collator's
    one): every document as alone; the padding's positions (any value) mark nothing."""
    config = tiny_config(is_causal=True, token_shift=True)
    model = randomize_(RANModel(config), seed=2)
    rows = [make_documents(config.vocab_size, [4, 9], seed=1), make_documents(config.vocab_size, [6, 1, 2], seed=2)]
    ids, mask = pad_batch([torch.cat(row) for row in rows], side="left")
    positions = torch.full(ids.shape, 1)
    for r, row in enumerate(rows):
        positions[r, ids.shape[1] - sum(map(len, row)) :] = torch.cat([torch.arange(len(d)) for d in row])
    with torch.no_grad():
        packed = model(ids, attention_mask=mask, position_ids=positions)
        for r, row in enumerate(rows):
            start = ids.shape[1] - sum(map(len, row))
            for document, tokens in zip(row, spans(row)):
                tokens = slice(start + tokens.start, start + tokens.stop)
                alone = model(document[None])
                assert_close(packed.last_hidden_state[r : r + 1, tokens], alone.last_hidden_state, f"row {r}")
        assert packed.pooler_output.shape[0] == 5  # one per document
        assert packed.last_hidden_state[mask == 0].abs().max() == 0


def padded_documents(documents):
    return pad_batch(documents, side="right")


def test_causal_lm_logits_loss_and_gradients_match_documents_alone():
    config = tiny_config(is_causal=True, window_overlap=1, token_shift=True, associative_memory=True)
    model = randomize_(RANForCausalLM(config), seed=3)
    documents = make_documents(config.vocab_size, seed=3)
    collated = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist()} for d in documents]
    )
    packed = model(**collated)
    ids, mask = padded_documents(documents)
    batch = model(ids, attention_mask=mask, labels=ids)  # the documents alone, as one padded batch
    for index, (document, tokens) in enumerate(zip(documents, spans(documents))):
        assert_close(packed.logits[:, tokens], batch.logits[index : index + 1, : len(document)], f"logits of {index}")
    assert_close(packed.loss, batch.loss, "loss")
    # Labels that do not mark where documents start: no document's first token is predicted from the one before.
    unmarked = model(
        input_ids=collated["input_ids"], position_ids=collated["position_ids"], labels=collated["input_ids"]
    )
    assert_close(unmarked.loss, batch.loss, "loss with the inputs as labels")
    unscored = model(input_ids=collated["input_ids"], cu_seq_lens_q=collated["cu_seq_lens_q"])  # no labels
    assert_close(unscored.logits, packed.logits, "logits without labels")
    assert_same_gradients(model, packed.loss, batch.loss)


def test_causal_lm_shift_labels_do_not_reach_across_documents():
    config = tiny_config(is_causal=True)
    model = randomize_(RANForCausalLM(config), seed=4)
    documents = make_documents(config.vocab_size, [6, 4, 8], seed=4)
    inputs = packed_inputs(documents)
    ids = inputs["input_ids"]
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # crosses every boundary
    packed = model(**inputs, labels=ids, shift_labels=shifted)
    padded, mask = padded_documents(documents)
    assert_close(packed.loss, model(padded, attention_mask=mask, labels=padded).loss, "loss")


@pytest.mark.parametrize("boundaries", BOUNDARIES)
def test_masked_lm_logits_loss_and_gradients_match_documents_alone(boundaries):
    config = tiny_config(window_overlap=2)
    model = randomize_(RANForMaskedLM(config), seed=5)
    documents = make_documents(config.vocab_size, seed=5)
    inputs = packed_inputs(documents, boundaries)
    labels = inputs["input_ids"].masked_fill(torch.rand(inputs["input_ids"].shape) < 0.5, -100)
    packed = model(**inputs, labels=labels)
    ids, mask = padded_documents(documents)
    label_rows, _ = pad_batch([labels[0, tokens] for tokens in spans(documents)], pad_id=-100)
    batch = model(ids, attention_mask=mask, labels=label_rows)
    for index, (document, tokens) in enumerate(zip(documents, spans(documents))):
        assert_close(packed.logits[:, tokens], batch.logits[index : index + 1, : len(document)], f"logits of {index}")
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_token_classifier_matches_documents_alone(is_causal):
    config = tiny_config(is_causal=is_causal, num_labels=3, window_overlap=1)
    model = randomize_(RANForTokenClassification(config), seed=6)
    documents = make_documents(config.vocab_size, seed=6)
    inputs = packed_inputs(documents, "cu_seq_lens")
    labels = torch.randint(0, 3, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(6))
    packed = model(**inputs, labels=labels)
    ids, mask = padded_documents(documents)
    label_rows, _ = pad_batch([labels[0, tokens] for tokens in spans(documents)], pad_id=-100)
    batch = model(ids, attention_mask=mask, labels=label_rows)
    for index, (document, tokens) in enumerate(zip(documents, spans(documents))):
        assert_close(packed.logits[:, tokens], batch.logits[index : index + 1, : len(document)], f"logits of {index}")
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "causal"])
def test_sequence_classifier_gives_one_row_per_document(is_causal):
    config = tiny_config(is_causal=is_causal, num_labels=3, cell_pooling="max")
    model = randomize_(RANForSequenceClassification(config), seed=7)
    documents = make_documents(config.vocab_size, seed=7)
    labels = torch.tensor([0, 2, 1, 1, 0])  # one per document
    packed = model(**packed_inputs(documents), labels=labels)
    ids, mask = padded_documents(documents)
    batch = model(ids, attention_mask=mask, labels=labels)
    assert_close(packed.logits, batch.logits, "logits")
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)
    with pytest.raises(ValueError, match="5"):
        model(**packed_inputs(documents), labels=torch.tensor([0]))  # one label for the packed row: refused


def test_question_answering_logits_and_loss_match_documents_alone():
    config = tiny_config(window_overlap=1)
    model = randomize_(RANForQuestionAnswering(config), seed=8)
    documents = make_documents(config.vocab_size, seed=8)
    starts, ends = torch.tensor([1, 0, 4, 3, 2]), torch.tensor([3, 0, 9, 3, 5])  # per document; 3 is past doc 3
    packed = model(**packed_inputs(documents), start_positions=starts, end_positions=ends)
    ids, mask = padded_documents(documents)
    batch = model(ids, attention_mask=mask, start_positions=starts, end_positions=ends)
    for index, (document, tokens) in enumerate(zip(documents, spans(documents))):
        for side in ("start_logits", "end_logits"):
            assert_close(packed[side][:, tokens], batch[side][index : index + 1, : len(document)], f"{side} {index}")
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)


def test_prefix_lm_matches_documents_alone():
    config = tiny_config()
    model = randomize_(RANForPrefixLM(config), seed=9)
    documents = make_documents(config.vocab_size, [8, 12, 6], seed=9)
    types = [torch.tensor([0] * s + [1] * (len(d) - s)) for d, s in zip(documents, (3, 7, 2))]
    inputs = packed_inputs(documents)
    packed = model(**inputs, token_type_ids=torch.cat(types)[None], labels=inputs["input_ids"])
    ids, mask = padded_documents(documents)
    type_rows, _ = pad_batch(types)
    batch = model(ids, attention_mask=mask, token_type_ids=type_rows, labels=ids)
    for index, (document, tokens) in enumerate(zip(documents, spans(documents))):
        assert_close(packed.logits[:, tokens], batch.logits[index : index + 1, : len(document)], f"logits of {index}")
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)


def test_positions_that_do_not_restart_change_nothing():
    """Position ids of one document per row (continuing, from any start) take the ordinary path."""
    config = tiny_config(is_causal=True)
    model = randomize_(RANForCausalLM(config), seed=10)
    ids = random_ids(12, config.vocab_size, seed=10)[None].repeat(2, 1)
    with torch.no_grad():
        plain = model(ids).logits
        assert torch.equal(model(ids, position_ids=torch.arange(12)[None] + 5).logits, plain)
        offsets = torch.tensor([0, 12], dtype=torch.int32)
        one = model(ids[:1]).logits
        assert torch.equal(model(ids[:1], cu_seq_lens_q=offsets, cu_seq_lens_k=offsets).logits, one)


# ---- refused: what a packed row cannot read exactly, and markers that do not fit the inputs ------------------------


def never_embedded(model):
    def hook(*_):
        raise AssertionError("the model embedded tokens before refusing")

    return model.get_input_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize(
    "extra, message",
    [
        pytest.param({"use_cache": True}, "cache", id="use_cache"),
        pytest.param({"initial_cell": torch.zeros(1, 16)}, "initial_cell", id="initial_cell"),
    ],
)
def test_packed_row_with_a_cache_or_a_starting_cell_is_refused(extra, message):
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=11)
    inputs = packed_inputs(make_documents(61, [4, 6]))
    never_embedded(model)
    with pytest.raises(ValueError, match=message):
        model(**inputs, **extra)


def test_packed_row_continuing_a_cache_is_refused():
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=12)
    cache = model(random_ids(5, 61, seed=1)[None], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cache"):
        model(**packed_inputs(make_documents(61, [4, 6])), past_key_values=cache)


def offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "inputs, message",
    [
        pytest.param({"cu_seq_lens_q": offsets(0, 4, 9)}, "end at the row's length, 10", id="short-offsets"),
        pytest.param({"cu_seq_lens_q": offsets(1, 4, 10)}, "start at 0", id="offsets-not-from-0"),
        pytest.param({"cu_seq_lens_q": offsets(0, 4, 4, 10)}, "increase", id="empty-document"),
        pytest.param(
            {"cu_seq_lens_q": offsets(0, 4, 10), "cu_seq_lens_k": offsets(0, 5, 10)}, "differ", id="q-k-differ"
        ),
        pytest.param({"position_ids": torch.arange(9)[None]}, "shape", id="positions-shape"),
        pytest.param({"position_ids": torch.zeros(1, 10)}, "integer", id="float-positions"),
        pytest.param({"position_ids": torch.ones(1, 10, dtype=torch.bool)}, "integer", id="bool-positions"),
        pytest.param({"cu_seq_lens_q": [0, 4, 12]}, r"length, 10 \(got \[0, 4, 12\]\)", id="offsets-as-a-list"),
        pytest.param(
            {"cu_seq_lens_q": offsets(0, 4, 10), "attention_mask": torch.tensor([[1] * 9 + [0]])},
            "padding",
            id="offsets-with-padding",
        ),
    ],
)
def test_markers_that_do_not_fit_the_inputs_are_refused(inputs, message):
    model = randomize_(RANModel(tiny_config()), seed=13)
    never_embedded(model)
    with pytest.raises(ValueError, match=message):
        model(random_ids(10, 61, seed=3)[None], **inputs)


@pytest.mark.parametrize(
    "inputs",
    [
        pytest.param({"cu_seq_lens_q": offsets(0, 5, 10)}, id="cu_seq_lens"),
        pytest.param({"seq_idx": torch.tensor([[0] * 5 + [1] * 5])}, id="seq_idx"),
    ],
)
def test_markers_that_mark_different_documents_are_refused(inputs):
    """Several markers given must mark the same documents: they were read together, every boundary of either."""
    model = randomize_(RANModel(tiny_config()), seed=13)
    never_embedded(model)
    positions = torch.cat([torch.arange(4), torch.arange(6)])[None]  # a restart at 4
    with pytest.raises(ValueError, match=r"`position_ids` and `(cu_seq_lens_q|seq_idx)` mark different documents"):
        model(random_ids(10, 61, seed=3)[None], position_ids=positions, **inputs)


def test_positions_that_count_a_padding_hole_keep_one_document():
    """`position_ids = arange(L)` with a masked hole: the positions after the hole count it, and the document goes
    on, as without the positions (it was read as two documents)."""
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True)), seed=15)
    ids = random_ids(9, 61, seed=4)[None]
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        counted = model(ids, attention_mask=mask, position_ids=torch.arange(9)[None]).logits
        skipped = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        plain = model(ids, attention_mask=mask).logits
    real = mask[0].bool()
    assert_close(counted[:, real], plain[:, real], "positions that count the hole")
    assert_close(skipped[:, real], plain[:, real], "positions that skip the hole")


def test_offsets_for_several_rows_are_refused():
    model = randomize_(RANModel(tiny_config()), seed=14)
    with pytest.raises(ValueError, match="2 rows"):
        model(random_ids(10, 61, seed=3)[None].repeat(2, 1), cu_seq_lens_q=offsets(0, 4, 10))


# ---- Trainer with DataCollatorWithFlattening ------------------------------------------------------------------------


class Documents(Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 14, (count,), generator=generator).tolist()
        # A learnable pattern: each document counts up from a random start.
        starts = torch.randint(1, 30, (count,), generator=generator).tolist()
        self.documents = [list(range(s, s + n)) for s, n in zip(starts, lengths)]

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, index):
        return {"input_ids": self.documents[index]}


class MaskedDocuments(Documents):
    """Each document with its masked-LM labels, masked once (the collator flattens what it is given; run_mlm.py's
    `--packing` masks the packed row instead)."""

    def __getitem__(self, index):
        ids = list(self.documents[index])
        generator = torch.Generator().manual_seed(index)
        masked = (torch.rand(len(ids), generator=generator) < 0.3).tolist()
        masked[len(ids) // 2], masked[0] = True, False  # the first token stands for a [CLS]: the collator drops
        # its label (`separator_id`), as it does a causal LM's
        labels = [token if m else -100 for token, m in zip(ids, masked)]
        return {"input_ids": [60 if m else token for token, m in zip(ids, masked)], "labels": labels}


def losses_of(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("head", ["causal", "masked"])
def test_trainer_with_flattening_collator_learns(head, tmp_path):
    torch.manual_seed(0)
    config = tiny_config(is_causal=head == "causal", window_size=4, min_window_size=1)
    model = (RANForCausalLM if head == "causal" else RANForMaskedLM)(config)
    dataset = (Documents if head == "causal" else MaskedDocuments)(64, seed=0)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=100, learning_rate=2e-2,
        logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    batch = collator([dataset[i] for i in range(8)])
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in batch  # one packed row
    trainer.train()
    losses = losses_of(trainer)
    assert sum(losses[-3:]) / 3 < 0.85 * losses[0], losses
    # What it trained on was each document alone: a packed batch's loss is the padded batch's.
    model.eval()
    features = [dataset[i] for i in range(8, 16)]
    ids, mask = pad_batch([torch.tensor(f["input_ids"]) for f in features])
    labels = ids.masked_fill(mask == 0, -100)
    if head == "masked":
        labels, _ = pad_batch([torch.tensor(f["labels"]) for f in features], pad_id=-100)
    with torch.no_grad():
        packed = model(**collator(features)).loss
        assert_close(packed, model(ids, attention_mask=mask, labels=labels).loss, "loss")


# ---- the other ways in: embeddings, tuples, chosen hidden states, checkpointing, the adaptive softmax ---------------


def test_embeddings_tuples_and_chosen_hidden_states_come_back_packed():
    config = tiny_config(is_causal=True, token_shift=True)
    model = randomize_(RANModel(config), seed=15)
    documents = make_documents(config.vocab_size, [6, 2, 9], seed=15)
    inputs = packed_inputs(documents)
    embeds = model.get_input_embeddings()(inputs.pop("input_ids"))
    with torch.no_grad():
        packed = model(inputs_embeds=embeds, **inputs, output_hidden_states=[0, -1])
        as_tuple = model(inputs_embeds=embeds, **inputs, return_dict=False)
        for document, tokens in zip(documents, spans(documents)):
            alone = model(document[None], output_hidden_states=True)
            assert_close(packed.last_hidden_state[:, tokens], alone.last_hidden_state, "token states")
            assert_close(packed.hidden_states[0][:, tokens], alone.hidden_states[0], "embedding output")
            assert_close(packed.hidden_states[-1][:, tokens], alone.hidden_states[-1], "last hidden states")
            assert_close(as_tuple[0][:, tokens], alone.last_hidden_state, "token states as a tuple")
    assert packed.hidden_states[1] is None


def test_gradient_checkpointing_reads_each_document_alone():
    config = tiny_config(is_causal=True, window_overlap=1)
    model = randomize_(RANForCausalLM(config), seed=16).train()
    model.gradient_checkpointing_enable()
    documents = make_documents(config.vocab_size, seed=16)
    packed = model(**packed_inputs(documents), labels=torch.cat(documents)[None])
    ids, mask = padded_documents(documents)
    batch = model(ids, attention_mask=mask, labels=ids)
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)


def test_adaptive_softmax_loss_matches_documents_alone():
    config = tiny_config(is_causal=True, vocab_size=80, cutoffs=[20, 50])
    model = randomize_(RANForCausalLM(config), seed=17)
    documents = make_documents(config.vocab_size, [9, 4, 12], seed=17)
    ids, mask = padded_documents(documents)
    packed = model(**packed_inputs(documents, "cu_seq_lens"), labels=torch.cat(documents)[None])
    batch = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert_close(packed.loss, batch.loss, "loss")
    assert_same_gradients(model, packed.loss, batch.loss)
