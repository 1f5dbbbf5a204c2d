"""ONNX export of a RAN: one graph for any batch size and length.

The graph takes `input_ids` and `attention_mask` (batch, sequence), padding on either side, and returns the model's
output fields by name (`last_hidden_state`, `logits`, ...). Inside, the window layout is sized from the input's
shape (every sequence has room for the most windows; the ones it lacks stay empty) and the cell scan is one ONNX
`Scan` over the windows. Needs `pip install ran-hf[onnx]` (onnxscript; onnxruntime to run the graph).

A causal model is exported without its recurrent cache: the graph reads whole texts (logits for every position),
and generation stays in PyTorch.
"""

import inspect
import os
from pathlib import Path

import torch

from ..files.folders import check_file_output, write_file
from ..modeling_ran import RANPreTrainedModel


INPUT_NAMES = ("input_ids", "attention_mask")
# The first bytes of an ONNX `ModelProto`: field 1 (`ir_version`, a small varint), then the tag of one of the fields
# that follow it (producer name and version, domain, model version, doc string, graph, opset, metadata, ...).
ONNX_SECOND_FIELDS = {0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42, 0x72, 0xA2, 0xCA}


def is_onnx_graph(path: Path) -> bool:
    """Whether the file `path` begins as an ONNX model does (what `export_onnx` wrote there before): not model
    weights (safetensors, `torch.save`), JSON or other text."""
    with open(path, "rb") as file:
        start = file.read(3)
    return len(start) == 3 and start[0] == 0x08 and 0 < start[1] < 0x80 and start[2] in ONNX_SECOND_FIELDS


def check_onnx_output(path: str | os.PathLike, flag: str = "path") -> None:
    """Refuse an export to `path` that would replace something other than an ONNX graph: a name (or a link's target)
    without `.onnx` (model weights, a config), a folder, or an existing file that is not an ONNX graph. Its external
    data (`PATH.data`, models over 2 GB) is replaced with it."""
    check_file_output(path, flag, ".onnx", is_onnx_graph, "an ONNX graph")


def example_inputs(model: RANPreTrainedModel) -> dict:
    """Two texts of two windows and a bit, the second one left-padded: every part of the layout is traced."""
    length = 2 * model.config.window_size + 3
    input_ids = torch.arange(2 * length).view(2, length) % model.config.vocab_size
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    device = model.device
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    return inputs


def export_refusal(model: RANPreTrainedModel) -> str | None:
    """Why `model` cannot be exported, or None: a head that cannot be says so (`onnx_export_refusal`, the prefix LM),
    and so does an option the graph cannot hold."""
    if getattr(model, "onnx_export_refusal", None):
        return model.onnx_export_refusal
    if getattr(model.config, "memory_salient_cells", None):
        return (
            f"{type(model).__name__} with `memory_salient_cells` cannot be exported to ONNX: choosing the salient "
            "cells sorts them stably (ties go to the older window), which ONNX's converter has no function for. "
            "Export a model without it (`memory_review_cells` alone exports), or run the PyTorch model."
        )
    return None


def export_onnx(model: RANPreTrainedModel, path: str | os.PathLike | None = None, **export_kwargs):
    """Export `model` (`RANModel` or any head) with dynamic batch size and sequence length; returns the
    `torch.onnx.ONNXProgram` and, with `path`, saves it there (`save_atomically`).

    `path` must be a `.onnx` file, new or an earlier graph: anything else (the model's weights, a config, a folder) is
    refused with a `ValueError` before the export (`check_onnx_output`). `export_kwargs` go to `torch.onnx.export`
    (e.g. `opset_version`). The model is put in eval mode.
    """
    if path is not None:
        check_onnx_output(path)
    refusal = export_refusal(model)
    if refusal:  # at once: torch.export would fail after tracing, its reason deep in a TorchExportError
        raise NotImplementedError(refusal)
    model.eval()
    inputs = example_inputs(model)
    with torch.no_grad():
        outputs = model(**inputs)
    output_names = [name for name, value in outputs.items() if isinstance(value, torch.Tensor)]
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence", min=2)
    dynamic_shapes = {name: {0: batch, 1: sequence} for name in INPUT_NAMES}
    if "use_cache" in inputs:
        dynamic_shapes["use_cache"] = None
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            (),
            kwargs=inputs,
            input_names=list(INPUT_NAMES),
            output_names=output_names,
            dynamic_shapes=dynamic_shapes,
            dynamo=True,
            **{"verbose": False, **export_kwargs},
        )
    if path is not None:
        save_atomically(program, Path(path))
    return program


def save_atomically(program, path: Path) -> None:
    """Save through `ran_hf.files.folders.write_file`, the guarded writer of the package's single files: `path` is
    checked (`check_onnx_output`) and locked, the graph saved into a folder beside it (links resolved: a link's target
    is written, on its file system) and the files moved into place, the graph last: a killed export never leaves a
    half-written file, nor a graph whose external weights (models over 2 GB) are missing."""
    with write_file(path, "path", ".onnx", is_onnx_graph, "an ONNX graph") as staged:
        program.save(staged)
