#!/usr/bin/env python
"""Export a saved RAN (any head) to ONNX and check the graph against PyTorch with ONNX Runtime.

    python scripts/export_onnx.py --model_dir outputs/ran-20ng --output outputs/ran-20ng/model.onnx

The graph takes `input_ids` and `attention_mask` of any batch size and length and returns the model's output fields
by name (see `ran_hf.export_onnx`). After exporting, the script runs padded batches of several lengths (shorter than
a window, not a multiple of it, several windows) through ONNX Runtime and PyTorch and prints the largest difference
per output; it exits with an error if one exceeds `--tolerance`. Needs `pip install ran-hf[onnx]`.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from argument_checks import in_range

import ran_hf
from ran_hf.files.paths import check_not_inputs


def load_model(model_dir: str) -> ran_hf.RANPreTrainedModel:
    """The class the folder was saved from (`architectures` in its config.json), in float32 for the comparison."""
    if not Path(model_dir).is_dir():  # else Transformers reads the path as a Hub repo id, and says so
        what = "is a file, not a folder" if Path(model_dir).exists() else "does not exist"
        raise OSError(f"--model_dir {model_dir} {what}: give the folder `save_pretrained` wrote.")
    model_type = ran_hf.RANConfig.get_config_dict(model_dir)[0].get("model_type")
    if model_type != ran_hf.RANConfig.model_type:  # RANConfig would read another model's config with a warning
        raise ValueError(
            f"{model_dir}: its config.json has model_type {model_type!r}, not {ran_hf.RANConfig.model_type!r}: this "
            "script exports RAN models (a folder saved by ran_hf or its training scripts). Other models export with "
            "their own tools (`optimum-cli export onnx`, say)."
        )
    config = ran_hf.RANConfig.from_pretrained(model_dir)
    architecture = (config.architectures or ["RANModel"])[0]
    model_class = getattr(ran_hf, architecture, None)
    if model_class is None:
        raise ValueError(f"{model_dir}: config.json names the architecture {architecture!r}, which ran_hf lacks")
    return model_class.from_pretrained(model_dir, dtype=torch.float32)


def check_output(model_dir: str, output: str) -> None:
    """Refuse an --output that is not a `.onnx` file or an earlier graph (`ran_hf.integrations.onnx_export.check_onnx_output`, which
    `ran_hf.export_onnx` checks too), or that is (links resolved) a file the model is read from: the export would
    overwrite the weights or config with the graph."""
    from ran_hf.integrations.onnx_export import check_onnx_output

    check_onnx_output(output, "--output")
    if not Path(model_dir).is_dir():
        return  # load_model says what is missing
    earlier_export = (".onnx", ".onnx.data")  # replaced, not read
    model_files = [
        path for path in Path(model_dir).iterdir() if path.is_file() and not path.name.endswith(earlier_export)
    ]
    external_data = f"{output}.data"  # where weights over 2 GB go
    for written, flag in ((output, "--output"), (external_data, f"--output's external data {external_data}")):
        check_not_inputs(written, flag, [(f"a file of --model_dir, {path.name},", path) for path in model_files])


def check_batches(config: ran_hf.RANConfig, batch_size: int, seed: int = 0):
    """Padded batches of a few lengths around the window size; the second row is left-padded, the last right-padded."""
    generator = torch.Generator().manual_seed(seed)
    window = config.window_size
    for length in (max(2, window // 2), 2 * window + 1, 4 * window + 3):
        input_ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        if batch_size > 1:
            attention_mask[1, : length // 3] = 0
        if batch_size > 2:
            attention_mask[-1, length - length // 4 :] = 0
        yield input_ids, attention_mask


def largest_differences(model, session, input_ids, attention_mask) -> dict[str, float]:
    """Largest absolute difference between ONNX Runtime and PyTorch per output (cells: the windows PyTorch has)."""
    kwargs = {"use_cache": False} if model.config.is_causal else {}
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask, **kwargs)
    feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
    differences = {}
    for output, value in zip(session.get_outputs(), session.run(None, feeds)):
        reference = expected[output.name].float().numpy()
        value = value[:, : reference.shape[1]] if output.name in ("cells", "cells_mask") else value
        differences[output.name] = float(np.abs(value.astype(np.float32) - reference).max())
    return differences


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="a folder saved with save_pretrained")
    parser.add_argument("--output", required=True, help="the .onnx file to write (replaced if it exists)")
    parser.add_argument(
        "--opset_version",
        type=in_range(int, at_least=1),
        default=None,
        help="ONNX opset (the exporter's default if unset)",
    )
    parser.add_argument("--batch_size", type=in_range(int, at_least=1), default=3, help="rows of each check batch")
    parser.add_argument(
        "--tolerance", type=in_range(float, at_least=0), default=1e-4, help="largest allowed absolute difference"
    )
    args = parser.parse_args(argv)
    try:
        check_output(args.model_dir, args.output)
    except ValueError as error:
        parser.exit(1, f"error: {error}\n")
    try:
        import onnxruntime
    except ImportError:
        parser.exit(1, "error: the check needs onnxruntime: pip install ran-hf[onnx]\n")
    try:
        model = load_model(args.model_dir)
    except (OSError, ValueError) as error:
        parser.exit(1, f"error: {error}\n")
    from ran_hf.integrations.onnx_export import export_refusal

    refusal = export_refusal(model)  # a head or option the graph cannot hold: said at once, without a traceback
    if refusal:
        parser.exit(1, f"error: {args.model_dir}: {refusal}\n")

    export_kwargs = {} if args.opset_version is None else {"opset_version": args.opset_version}
    start = time.perf_counter()
    ran_hf.export_onnx(model, args.output, **export_kwargs)
    export_seconds = time.perf_counter() - start
    print(f"Exported {type(model).__name__} to {args.output} in {export_seconds:.1f} s")

    session = onnxruntime.InferenceSession(args.output)
    worst: dict[str, float] = {}
    for input_ids, attention_mask in check_batches(model.config, args.batch_size):
        for name, difference in largest_differences(model, session, input_ids, attention_mask).items():
            worst[name] = max(worst.get(name, 0.0), difference)
    report = {"export_seconds": round(export_seconds, 1), "largest_difference": worst}
    print(json.dumps(report, indent=2))
    failed = [name for name, difference in worst.items() if not difference <= args.tolerance]
    if failed:
        parser.exit(1, f"error: ONNX Runtime differs from PyTorch by more than {args.tolerance} in {failed}\n")
    print(f"ONNX Runtime matches PyTorch within {args.tolerance} on padded batches of {Path(args.output).name}")
    return report


if __name__ == "__main__":
    main()
