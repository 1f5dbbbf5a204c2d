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
import shutil
from pathlib import Path

import torch

from .folders import lock_folder, resolved
from .modeling_ran import RANPreTrainedModel

INPUT_NAMES = ("input_ids", "attention_mask")


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


def export_onnx(model: RANPreTrainedModel, path: str | os.PathLike | None = None, **export_kwargs):
    """Export `model` (`RANModel` or any head) with dynamic batch size and sequence length; returns the
    `torch.onnx.ONNXProgram` and, with `path`, saves it there (`save_atomically`).

    `export_kwargs` go to `torch.onnx.export` (e.g. `opset_version`). The model is put in eval mode.
    """
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
    """Save into a folder beside `path` (links resolved: a link's target is written, on its file system), then move
    the files into place, the graph last: a killed export never leaves a half-written file, nor a graph whose external
    weights (models over 2 GB) are missing. The file is locked meanwhile (`ran_hf.folders.lock_folder`)."""
    path = resolved(path)
    lock = lock_folder(path)
    try:
        staging = path.parent / f".{path.name}.exporting-{os.getpid()}"
        staging.mkdir(parents=True)
        try:
            program.save(staging / path.name)
            for written in sorted(staging.iterdir(), key=lambda file: file.name == path.name):
                os.replace(written, path.parent / written.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        lock.release()
