"""The weights files a load reads, looked at before any tensor is: the weight names in their headers, a damaged
file named, and the cell weights of an older layout refused with the conversion to run. A saved folder ships this
module flat (files/saved_code.py), beside the model's."""

import pickle
import re

import torch
from safetensors import SafetensorError, safe_open


# Weights saved while the cell's own GLU and norm were the layer's, `layers.N.cell_glu.*` and `layers.N.cell_norm.*`
# (today `layers.N.cell_scan.cell_glu.*`): no public checkpoint has them, so they are not renamed on loading, which
# would also make Transformers write them back on saving. Loading them is refused with the conversion to run.
OLD_CELL_WEIGHT = re.compile(r"(^|\.)(layers\.\d+)\.(cell_glu|cell_norm)\.")


CELL_WEIGHTS_CONVERSION = "python -m ran_hf.integrations.rename_cell_weights FOLDER"


def todays_cell_weight_name(name: str) -> str:
    """`name` with an old cell weight's name (`OLD_CELL_WEIGHT`) replaced by today's; any other name as it is."""
    return OLD_CELL_WEIGHT.sub(r"\1\2.cell_scan.\3.", name, count=1)


def check_no_old_cell_weights(names, source: str) -> None:
    """Refuse weights `names` (read from `source`) that include old cell weight names, before any tensor is read:
    without a renaming they would be dropped as unexpected and the cell's weights left at their initialisation."""
    names = set(names)
    old = sorted(name for name in names if OLD_CELL_WEIGHT.search(name))
    if not old:
        return
    both = [name for name in old if todays_cell_weight_name(name) in names]
    shown = ", ".join(old[:4]) + (f" and {len(old) - 4} more" if len(old) > 4 else "")
    message = (
        f"{source} holds the cell's weights under the names of an older RAN layout ({shown}); today's model names "
        "them `layers.N.cell_scan.cell_glu.*` and `layers.N.cell_scan.cell_norm.*`, and does not rename on loading. "
    )
    if both:
        message += (
            f"It also holds today's name for {len(both)} of them (e.g. {todays_cell_weight_name(both[0])}), so which "
            "weight is meant is unclear: remove one of each pair, then load."
        )
    else:
        message += (
            f"Convert the folder once with `{CELL_WEIGHTS_CONVERSION}` (a state dict with "
            "`ran_hf.integrations.rename_cell_weights.renamed_cell_weights(state_dict)`), then load it."
        )
    raise ValueError(message)


def checkpoint_weight_names(state_dict, checkpoint_files) -> list[str]:
    """The weight names `from_pretrained` is about to load: a state dict's keys, or the headers of the weights files
    (no tensor read). A file that does not open gives none here: loading names it (`damaged_weights_error`)."""
    if state_dict is not None:
        return list(state_dict)
    names = []
    for file in checkpoint_files or ():
        try:
            if str(file).endswith(".safetensors"):
                with safe_open(file, framework="pt") as weights:
                    names += weights.keys()
            else:  # a pickled checkpoint: its storage mapped, not read (`meta`)
                names += torch.load(file, map_location="meta", mmap=True, weights_only=True)
        except (SafetensorError, OSError, RuntimeError, pickle.UnpicklingError):
            continue
    return names


def damaged_weights_error(files: list[str], error: Exception) -> OSError:
    """An `OSError` naming the first of the safetensors `files` that does not open (or all of them, with `error`)."""
    for file in files:
        try:
            with safe_open(file, framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as problem:
            reason = str(problem).removeprefix("Error while deserializing header: ")
            break
    else:
        file, reason = ", ".join(map(str, files)) or "a weights file", str(error)
    return OSError(
        f"{file} is damaged or cut short ({reason}): the model's weights cannot be read. A full disk or an "
        "interrupted save, copy or download leaves a file so; save, copy or download it again."
    )
