#!/usr/bin/env python
"""Convert an official RAN checkpoint (TensorFlow, `rannet`) into a Transformers folder.

    python scripts/convert_rannet_checkpoint.py --rannet_dir rannet-v3-en-base --output_dir ran-v3-en-base

`--rannet_dir` holds the release as published: `config.json`, `vocab.txt` and `model.ckpt.*`. The output folder loads
with `AutoTokenizer` and `AutoModelForMaskedLM` (or another Auto class) and `trust_remote_code=True`. No TensorFlow is
needed. See `ran_hf.integrations.convert_rannet` for what is written.
"""

import argparse

from ran_hf import convert_rannet_checkpoint
from ran_hf.integrations.convert_rannet import OutputFolderNotEmptyError


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rannet_dir", required=True, help="folder with config.json, vocab.txt and model.ckpt.*")
    parser.add_argument("--output_dir", required=True, help="the Transformers folder to write")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model in --output_dir if it exists and is not empty (other files there stay)",
    )
    args = parser.parse_args(argv)
    try:
        output_dir = convert_rannet_checkpoint(args.rannet_dir, args.output_dir, overwrite=args.overwrite)
    except OutputFolderNotEmptyError as error:  # its message names the Python argument, overwrite=True
        parser.exit(1, f"error: {error.fix('add --overwrite')}\n")
    except (OSError, ValueError) as error:  # a missing, damaged or inconsistent input: the message says which
        parser.exit(1, f"error: {error}\n")
    print(f"Wrote {output_dir}")


if __name__ == "__main__":
    main()
