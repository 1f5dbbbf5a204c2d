"""Rename a RAN folder's cell weights from an older layout to today's: `layers.N.cell_glu.*` and
`layers.N.cell_norm.*` (saved while the cell's GLU and norm were the layer's) become `layers.N.cell_scan.cell_glu.*`
and `layers.N.cell_scan.cell_norm.*`. Loading refuses the old names (`files.weight_files.check_no_old_cell_weights`) and names
this conversion:

    python -m ran_hf.integrations.rename_cell_weights FOLDER

The folder's safetensors weights (one file or shards, with their index) are rewritten through the library's guarded
writer (`ran_hf.files.folders.write_folder`): the new files are complete beside the folder before they replace the old
ones, and everything else in the folder (config, code, tokenizer, a user's files) stays. Not shipped in saved folders.
"""

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from ..files.folders import write_folder
from ..files.weight_files import OLD_CELL_WEIGHT, todays_cell_weight_name


INDEX = "model.safetensors.index.json"


def renamed_cell_weights(state_dict: Mapping) -> dict:
    """`state_dict` with old cell weight names renamed to today's; other entries as they are. A name whose new name
    is also there is refused: which of the two weights is meant is unclear."""
    both = [
        name for name in state_dict if OLD_CELL_WEIGHT.search(name) and todays_cell_weight_name(name) in state_dict
    ]
    if both:
        raise ValueError(
            f"The weights hold both an old and today's name for {len(both)} cell weights (e.g. {both[0]} and "
            f"{todays_cell_weight_name(both[0])}): which one is meant is unclear. Remove one of each pair first."
        )
    return {todays_cell_weight_name(name): tensor for name, tensor in state_dict.items()}


def _weights_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(path.name for path in folder.glob("*.bin"))
        found = f"only {', '.join(pickled)}" if pickled else "no weights file"
        raise FileNotFoundError(
            f"{folder} holds {found}: this conversion rewrites safetensors weights. Load a pickled checkpoint with "
            "`torch.load`, convert it with `renamed_cell_weights`, and load that state dict."
        )
    return files


def rename_cell_weights(folder: str | Path) -> int:
    """Rewrite the safetensors weights of `folder` with today's cell weight names; return how many were renamed (0:
    the folder is left untouched)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder: give the folder of a saved RAN model.")
    files = _weights_files(folder)
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as weights:
            names[file] = list(weights.keys())
    renamed = sum(bool(OLD_CELL_WEIGHT.search(name)) for file_names in names.values() for name in file_names)
    if not renamed:
        return 0
    renamed_cell_weights(dict.fromkeys(name for file_names in names.values() for name in file_names))  # refuse pairs
    with write_folder(folder, "converting", carry_over=lambda name: True) as staging:
        for file in files:
            with safe_open(file, framework="pt") as weights:
                state = {name: weights.get_tensor(name) for name in names[file]}
                metadata = weights.metadata()
            save_file(renamed_cell_weights(state), staging / file.name, metadata=metadata)
        if (folder / INDEX).is_file():
            index = json.loads((folder / INDEX).read_text())
            index["weight_map"] = {todays_cell_weight_name(name): shard for name, shard in index["weight_map"].items()}
            (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return renamed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the folder of a saved RAN model, rewritten in place")
    folder = parser.parse_args(argv).folder
    renamed = rename_cell_weights(folder)
    print(f"Renamed {renamed} cell weights in {folder}." if renamed else f"{folder} has no old cell weight names.")


if __name__ == "__main__":
    main()
