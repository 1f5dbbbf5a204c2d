"""Ranges of the scripts' numeric flags, declared beside each flag and checked when the flags are parsed, before any
tokenizer is trained, data read or model built; the error names the flag.

A dataclass field declares its range in its metadata, with any of `at_least`, `above`, `at_most`, `below`:

    batch_size: int = field(default=8, metadata={"help": "Documents per batch.", "at_least": 1})

`parse_arguments` (Transformers' `HfArgumentParser`, then `check_ranges`) checks every such field; an argparse
script passes `in_range(int, at_least=1)` as a flag's `type`. A float flag must also be finite.
"""

import argparse
import copy
import dataclasses
import difflib
import math
import operator
import os
import sys
import typing

from transformers import HfArgumentParser


# A bound's metadata key: how it reads in an error, and the test a value must pass.
BOUNDS = {
    "at_least": ("at least", operator.ge),
    "above": ("more than", operator.gt),
    "at_most": ("at most", operator.le),
    "below": ("less than", operator.lt),
}


# Ranges of Transformers' own training flags that it does not check (zero batches or steps divide by zero or loop
# forever; a negative learning rate or NaN trains away from the data), checked like the scripts' own.
TRAINING_ARGUMENT_RANGES = {
    "per_device_train_batch_size": {"at_least": 1},
    "per_device_eval_batch_size": {"at_least": 1},
    "gradient_accumulation_steps": {"at_least": 1},
    "eval_accumulation_steps": {"at_least": 1},
    "learning_rate": {"above": 0},
    "weight_decay": {"at_least": 0},
    "max_grad_norm": {"at_least": 0},
    "adam_beta1": {"at_least": 0, "below": 1},
    "adam_beta2": {"at_least": 0, "below": 1},
    "adam_epsilon": {"at_least": 0},
    "label_smoothing_factor": {"at_least": 0, "below": 1},
    "save_steps": {"above": 0},
    "eval_steps": {"above": 0},
    "logging_steps": {"above": 0},
    "save_total_limit": {"at_least": 1},
    "dataloader_num_workers": {"at_least": 0},
    "seed": {"at_least": 0, "below": 2**32},
    "data_seed": {"at_least": 0, "below": 2**32},
}


def range_problem(value, bounds: dict) -> str | None:
    """What is wrong with `value` given `bounds` (`{"at_least": 1}`, ...), or None when it is in range."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if all(BOUNDS[name][1](value, bound) for name, bound in bounds.items()):
        return None
    wanted = " and ".join(f"{BOUNDS[name][0]} {bound}" for name, bound in bounds.items())
    return f"must be {wanted}, got {value}"


def check_ranges(arguments, ranges: dict[str, dict] | None = None) -> None:
    """Check the fields of one argument dataclass instance against the bounds in their metadata, and those named in
    `ranges` (`{"learning_rate": {"above": 0}}`: fields a parent class declares, such as Transformers' own flags).
    None (a flag left unset) is always allowed."""
    declared = {field.name: field.metadata for field in dataclasses.fields(arguments)}
    wanted = {name: {key: metadata[key] for key in BOUNDS if key in metadata} for name, metadata in declared.items()}
    for name, bounds in {**wanted, **(ranges or {})}.items():
        value = getattr(arguments, name, None)
        if not bounds or value is None or isinstance(value, bool):
            continue
        problem = range_problem(value, bounds)
        if problem:
            raise ValueError(f"--{name} {problem}.")


class RangedArgumentParser(HfArgumentParser):
    """`HfArgumentParser`, which hands a field's metadata to argparse, minus the bounds (argparse knows none)."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        if any(key in field.metadata for key in BOUNDS):
            field = copy.copy(field)
            field.metadata = {key: value for key, value in field.metadata.items() if key not in BOUNDS}
        HfArgumentParser._parse_dataclass_field(parser, field)


def parse_arguments(dataclass_types, argv: list[str] | None = None):
    """Command-line flags, or a single `.json` file holding them, into the given dataclasses, ranges checked."""
    parser = RangedArgumentParser(dataclass_types)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        parsed = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    for arguments in parsed:
        check_ranges(arguments)
    return parsed


def in_range(kind: type, **bounds):
    """An argparse `type=` that parses with `kind` and refuses a value outside `bounds` (argparse names the flag)."""

    def parse(text: str):
        value = kind(text)
        problem = range_problem(value, bounds)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording for text that is not a number
    return parse


def parse_override(annotation, text: str):
    """One `--config_overrides` value read as the type `annotation` accepts (the text itself where nothing else reads
    it: setting it then names the type expected)."""
    kinds, word = typing.get_args(annotation) or (annotation,), text.lower()
    if type(None) in kinds and word in ("none", "null"):
        return None
    if bool in kinds and word in ("true", "false", "1", "0", "yes", "no"):
        return word in ("true", "1", "yes")
    for kind in (int, float) if bool not in kinds else ():
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                pass
    if list[int] in kinds:
        try:
            return [int(item) for item in text.strip("[]").replace(";", ",").split(",") if item.strip()]
        except ValueError:
            pass
    return text


def split_overrides(text: str) -> list[str]:
    """`"a=1,cutoffs=[2,3],b=x"` -> `["a=1", "cutoffs=[2,3]", "b=x"]`: commas inside brackets belong to a list."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        items, current = (items + [current], "") if char == "," and depth <= 0 else (items, current + char)
    return [item for item in [*items, current] if item.strip()]


def apply_config_overrides(config, overrides: str) -> None:
    """`--config_overrides "name=value,name=value"`: set config fields, each value read by its field's type (ints,
    numbers, `true`/`false`, strings, `none`, lists of ints as `[2000,10000]` or `2000;10000`); nothing is set unless
    all parse and make a valid config. Errors are `ValueError`s naming the field."""
    previous, given = dict(config.__dict__), set()
    try:
        for item in split_overrides(overrides):
            name, equals, text = (part.strip() for part in item.partition("="))
            if not equals or not name:
                raise ValueError(f"`{item.strip()}` is not an override: write it `name=value` (joined by commas).")
            if name in given:
                raise ValueError(f"`{name}` is given twice in the overrides {overrides!r}: give it once.")
            given.add(name)
            if not hasattr(config, name) or name.startswith("_"):
                close = difflib.get_close_matches(name, list(config.__dataclass_fields__), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"`{name}` is not a field of {type(config).__name__}{hint}.")
            field = config.__dataclass_fields__.get(name)
            # A model's own field by its type; Transformers' (annotated as strings) and properties by their value's.
            typed = field is not None and not isinstance(field.type, str)
            setattr(config, name, parse_override(field.type if typed else type(getattr(config, name)), text))
        config.validate()
    except Exception as error:
        config.__dict__.clear()
        config.__dict__.update(previous)
        if isinstance(error, ValueError):
            raise
        raise ValueError(str(error.__cause__ or error)) from error  # `@strict`'s error: its cause names the field
