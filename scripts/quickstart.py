#!/usr/bin/env python
"""Build a small RAN, read a real text with it as one long document, save it and load it back as remote code.

    python scripts/quickstart.py                       # reads the project's README.md
    python scripts/quickstart.py --text_file book.txt --output_dir outputs/quickstart

Steps: train a lower-cased WordPiece tokenizer on the text, build a `RANForMaskedLM`, run the whole text through it
in a single sequence (RAN reads it window by window), fill a masked word, then `save_pretrained` and reload the
folder with `AutoModelForMaskedLM.from_pretrained(..., trust_remote_code=True)` and check the logits are identical.

A longer text is read up to its first `--max_tokens` tokens (a RAN's memory grows with what it reads; only that part of
the file is read at all). The folder is written as the training scripts write theirs (`ran_hf.files.folders`): locked
for the run, its model and tokenizer replaced once the new ones are saved (other files there, your notes for one,
stay), and a folder that holds anything but an earlier quickstart's model is refused without `--overwrite_output_dir`.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from argument_checks import in_range
from checkpoints import is_run_file
from data_loading import cut_at_whitespace, cut_for_tokenizer
from train_tokenizer import SPECIAL_TOKENS, TokenizerArguments, build_tokenizer
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline, set_seed

from ran_hf import RANConfig, RANForMaskedLM
from ran_hf.files.folder_locks import lock_folder, releases_folder_locks
from ran_hf.files.folders import write_folder
from ran_hf.files.paths import check_not_inputs, contents
from ran_hf.files.text_files import read_lines


MIN_WINDOW_SIZE = 8
# Characters read for each token kept: more than any token holds, so that the text read gives `--max_tokens` tokens.
CHARACTERS_PER_TOKEN = 64
# Written beside the model: what the quickstart read. It marks a folder that a later quickstart may replace.
MARKER = "quickstart.json"


def read_text(path: Path, characters: int) -> tuple[list[str], bool]:
    """The non-blank lines of the first `characters` characters of a UTF-8 file (a cut line ends at whitespace), and
    whether the file holds more."""
    try:
        with path.open(encoding="utf-8") as handle:
            text = handle.read(characters + 1)
    except UnicodeDecodeError as error:
        for _ in read_lines(path):  # names the encoding the file is in and the command that converts it
            pass
        raise ValueError(f"--text_file {path} is not UTF-8 text ({error.reason}); convert it to UTF-8.") from None
    more = len(text) > characters
    if more:
        text = cut_at_whitespace(text[:characters], characters, from_left=False)
    return [line.strip() for line in text.splitlines() if line.strip()], more


def check_output_dir(args: argparse.Namespace) -> None:
    """Before any work: an --output_dir apart from --text_file, locked for the run, and holding nothing but an earlier
    quickstart's model unless --overwrite_output_dir."""
    check_not_inputs(args.output_dir, "--output_dir", [("--text_file", args.text_file)])
    if args.output_dir.exists() and not args.output_dir.is_dir():
        raise ValueError(f"--output_dir {args.output_dir} is a file, not a folder.")
    lock_folder(args.output_dir)
    entries = contents(args.output_dir)
    if entries and MARKER not in entries and not args.overwrite_output_dir:
        shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
        raise ValueError(
            f"--output_dir {args.output_dir} holds files that an earlier quickstart did not write ({shown}): saving "
            "the quickstart's untrained model there would replace them. Choose another --output_dir, or pass "
            "--overwrite_output_dir to replace the model, tokenizer and results there (other files stay)."
        )


@releases_folder_locks
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text_file", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/quickstart"))
    parser.add_argument("--vocab_size", type=in_range(int, above=len(SPECIAL_TOKENS)), default=1000)
    parser.add_argument("--window_size", type=in_range(int, above=MIN_WINDOW_SIZE), default=64)
    parser.add_argument("--max_tokens", type=in_range(int, at_least=2), default=16_384, help="tokens of the text read")
    parser.add_argument("--seed", type=in_range(int, at_least=0, below=2**32), default=0)
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="replace an --output_dir that holds other files"
    )
    args = parser.parse_args(argv)
    if not args.text_file.exists():
        parser.error(f"--text_file {args.text_file} does not exist")
    if args.text_file.is_dir():
        parser.error(f"--text_file {args.text_file} is a folder: give a text file")
    try:
        check_output_dir(args)
        lines, more = read_text(args.text_file, CHARACTERS_PER_TOKEN * args.max_tokens)
    except ValueError as error:
        parser.error(str(error))
    if not lines:
        parser.error(f"--text_file {args.text_file} holds no text")
    set_seed(args.seed)

    tokenizer_args = TokenizerArguments(train_files=[str(args.text_file)], output_dir=str(args.output_dir))
    tokenizer_args.vocab_size, tokenizer_args.min_frequency = args.vocab_size, 1
    tokenizer = build_tokenizer(tokenizer_args, lines)
    config = RANConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        window_size=args.window_size,
        min_window_size=MIN_WINDOW_SIZE,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = RANForMaskedLM(config).eval()
    print(f"RAN with {model.num_parameters():,} parameters, vocabulary {len(tokenizer)}, window {config.window_size}")

    (text,) = cut_for_tokenizer(tokenizer, [" ".join(lines)], args.max_tokens)  # the part a truncation keeps
    encoded = tokenizer(text, truncation=True, max_length=args.max_tokens, return_tensors="pt")
    if more or encoded.input_ids.shape[1] == args.max_tokens:
        print(f"Reading the first {encoded.input_ids.shape[1]:,} tokens of {args.text_file.name} (--max_tokens)")
    start = time.perf_counter()
    with torch.no_grad():
        outputs = model.model(**encoded)
        logits = model(**encoded).logits
    num_windows = int(outputs.cells_mask.sum())
    print(
        f"Read {args.text_file.name}: {encoded.input_ids.shape[1]:,} tokens as one sequence, {num_windows} windows, "
        f"in {time.perf_counter() - start:.2f}s; document cell {tuple(outputs.pooled_cell.shape)}, "
        f"token states {tuple(outputs.last_hidden_state.shape)}"
    )

    fill_mask = pipeline("fill-mask", model=model, tokenizer=tokenizer)
    prompt = f"the model reads long {tokenizer.mask_token} in windows ."
    guesses = ", ".join(f"{g['token_str']} ({g['score']:.3f})" for g in fill_mask(prompt, top_k=3))
    print(f"fill-mask (untrained weights) for {prompt!r}: {guesses}")

    # What a run writes (model, tokenizer, results) is replaced; other entries (a user's notes) stay.
    with write_folder(args.output_dir, "saving", carry_over=lambda name: not is_run_file(name)) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        read = {"text_file": str(args.text_file.resolve()), "tokens": encoded.input_ids.shape[1]}
        (staging / MARKER).write_text(json.dumps(read, indent=2) + "\n", encoding="utf-8")
    reloaded = AutoModelForMaskedLM.from_pretrained(args.output_dir, trust_remote_code=True).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(args.output_dir)
    with torch.no_grad():
        reloaded_logits = reloaded(
            **reloaded_tokenizer(text, truncation=True, max_length=args.max_tokens, return_tensors="pt")
        ).logits
    # Identical weights; float sums may still differ in the last bits with the memory layout of the loaded tensors.
    difference = (reloaded_logits - logits).abs().max().item()
    if difference > 1e-5:
        raise SystemExit(f"Reloaded model disagrees with the saved one: max abs diff {difference:.3e}")
    saved = ", ".join(sorted(p.name for p in args.output_dir.iterdir()))
    print(
        f"Saved to {args.output_dir.resolve()} ({saved}); reloaded with AutoModelForMaskedLM, "
        f"logits equal within {difference:.1e}."
    )


if __name__ == "__main__":
    main()
