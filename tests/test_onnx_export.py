"""ONNX export (`ran_hf.export_onnx`, ONNX's dynamo exporter): one graph takes any batch size and length, padding on
either side, and ONNX Runtime gives PyTorch's outputs; the exports that cannot be right are refused with the fix."""

import export_onnx as export_script  # scripts/export_onnx.py
import numpy as np
import pytest
import torch
from ran_testing import randomize_, tiny_config

from ran_hf import RANForCausalLM, RANForSequenceClassification, RANModel, export_onnx


pytestmark = pytest.mark.slow  # each export traces and converts a model for tens of seconds

onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TOLERANCE = 1e-4
# (batch, length, padding): windows of 5 tokens; lengths that are and are not a multiple of the window, shorter
# than one window, and longer than the traced example (13 tokens).
BATCHES = [(3, 13, "right"), (1, 4, None), (2, 10, "left"), (4, 37, "both")]


def padded_batch(batch_size: int, length: int, padding: str | None, vocab_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(1, batch_size):  # row 0 keeps every token
        cut = (row * length) // (batch_size + 1)
        if padding in ("right", "both"):
            attention_mask[row, length - cut :] = 0
        if padding == "left" or (padding == "both" and row % 2):
            attention_mask[row, : max(1, cut // 2)] = 0
    return input_ids, attention_mask


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each model once, exported and loaded into ONNX Runtime: (model, session, output names)."""
    folder = tmp_path_factory.mktemp("onnx")
    models = {
        "model": RANModel(tiny_config()),
        "sequence-classification": RANForSequenceClassification(tiny_config(num_labels=3)),
        "causal-lm": RANForCausalLM(tiny_config(is_causal=True)),
        # Its windows written by a `scan` operator, the chunked write's inverse built from matmuls.
        "causal-lm-associative-memory": RANForCausalLM(
            tiny_config(is_causal=True, associative_memory=True, associative_key_conv=3, associative_decay=True)
        ),
    }
    sessions = {}
    for name, model in models.items():
        randomize_(model, seed=1)
        export_onnx(model, folder / f"{name}.onnx")
        session = onnxruntime.InferenceSession(str(folder / f"{name}.onnx"))
        sessions[name] = (model, session, [output.name for output in session.get_outputs()])
    return sessions


@pytest.mark.parametrize("name", ["model", "sequence-classification", "causal-lm", "causal-lm-associative-memory"])
@pytest.mark.parametrize("batch_size,length,padding", BATCHES)
def test_onnx_runtime_matches_pytorch_on_padded_batches(exported, name, batch_size, length, padding):
    model, session, output_names = exported[name]
    input_ids, attention_mask = padded_batch(batch_size, length, padding, model.config.vocab_size, seed=length)
    kwargs = {"use_cache": False} if model.config.is_causal else {}
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask, **kwargs)
    outputs = session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
    compared = 0
    for output_name, value in zip(output_names, outputs):
        reference = expected[output_name].float().numpy()
        if output_name in ("cells", "cells_mask"):
            # The graph has room for (length - 1) // window + 2 windows per text; the ones a text lacks are masked.
            value = value[:, : reference.shape[1]]
            assert not outputs[output_names.index("cells_mask")][:, reference.shape[1] :].any()
        assert value.shape == reference.shape, output_name
        np.testing.assert_allclose(value.astype(np.float32), reference, atol=TOLERANCE, rtol=0, err_msg=output_name)
        compared += 1
    assert compared == len(output_names) >= 1
    if name.startswith("causal-lm"):
        assert output_names == ["logits"]


def test_the_exported_graph_takes_padding_without_changing_a_text(exported):
    """The same text alone and left-padded in a batch gives the same hidden states through ONNX Runtime."""
    model, session, output_names = exported["model"]
    input_ids, attention_mask = padded_batch(2, 17, "left", model.config.vocab_size, seed=3)
    real = attention_mask[1].bool()
    padded = session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
    alone_ids = input_ids[1:, real]
    alone = session.run(None, {"input_ids": alone_ids.numpy(), "attention_mask": np.ones_like(alone_ids.numpy())})
    states = output_names.index("last_hidden_state")
    np.testing.assert_allclose(padded[states][1, real.numpy()], alone[states][0], atol=TOLERANCE, rtol=0)
    assert not padded[states][1, ~real.numpy()].any()  # zeros at padding, as in PyTorch


def test_a_model_without_the_cell_residual_exports_and_runs_as_in_pytorch(tmp_path):
    """Without the residual, a window's cell is its raw cell: the exported scan's carry holds one tensor twice."""
    model = randomize_(RANModel(tiny_config(use_cell_residual=False)), seed=2)
    export_onnx(model, tmp_path / "ran.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "ran.onnx"))
    input_ids, attention_mask = padded_batch(2, 23, "right", model.config.vocab_size, seed=4)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).last_hidden_state.numpy()
    outputs = session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
    states = [output.name for output in session.get_outputs()].index("last_hidden_state")
    np.testing.assert_allclose(outputs[states], expected, atol=TOLERANCE, rtol=0)


def test_export_saves_atomically_and_replaces_an_existing_file(tmp_path):
    import onnx
    from onnx import helper

    model = RANModel(tiny_config(num_hidden_layers=1))
    target = tmp_path / "ran.onnx"
    onnx.save(helper.make_model(helper.make_graph([], "an older export", [], [])), target)
    older = target.read_bytes()
    export_onnx(model, target)
    assert target.read_bytes() != older and onnx.load(target).graph.name != "an older export"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ran.onnx"]  # no staging folder left behind


def test_exports_that_cannot_be_right_are_refused_with_the_fix(tmp_path):
    model = RANForCausalLM(tiny_config(is_causal=True, num_hidden_layers=1)).eval()
    input_ids = torch.arange(12)[None] % model.config.vocab_size
    with pytest.raises(Exception, match="use_cache=False"):  # the recurrent cache cannot live in the graph
        with torch.no_grad():
            torch.onnx.export(model, (input_ids,), kwargs={"use_cache": True}, dynamo=True)
    with pytest.raises(Exception, match="torch.no_grad"):
        torch.onnx.export(model, (input_ids,), kwargs={"use_cache": False}, dynamo=True)
    with pytest.raises(NotImplementedError, match="dynamo=True"):  # one fixed number of windows
        torch.onnx.export(RANModel(tiny_config()).eval(), (input_ids,), tmp_path / "ran.onnx", dynamo=False)


def test_export_script_exports_a_saved_folder_and_checks_it(tmp_path, capsys):
    model = RANForSequenceClassification(tiny_config(num_labels=2, num_hidden_layers=1))
    randomize_(model, seed=2)
    model.save_pretrained(tmp_path / "classifier")
    report = export_script.main(["--model_dir", str(tmp_path / "classifier"), "--output", str(tmp_path / "c.onnx")])
    assert set(report["largest_difference"]) == {"logits"}
    assert report["largest_difference"]["logits"] <= 1e-4
    assert '"export_seconds"' in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:  # not a saved model: a clear error, nothing written
        export_script.main(["--model_dir", str(tmp_path / "empty"), "--output", str(tmp_path / "e.onnx")])
    assert exit_info.value.code == 1 and not (tmp_path / "e.onnx").exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_export_script_names_a_model_dir_that_is_no_folder(tmp_path, capsys, kind):
    """A --model_dir that does not exist was answered with the Hub's repo-id error."""
    model_dir = tmp_path / "model"
    if kind == "file":
        model_dir.write_text("not a model")
    with pytest.raises(SystemExit) as exit_info:
        export_script.main(["--model_dir", str(model_dir), "--output", str(tmp_path / "m.onnx")])
    what = "does not exist" if kind == "missing" else "is a file, not a folder"
    assert exit_info.value.code == 1 and f"--model_dir {model_dir} {what}" in capsys.readouterr().err
