"""The field machinery `RANConfig` declares its fields with: validators, `ValueError`s naming the field, the rules
between fields (the config's `validate_*` methods), the size estimate and bound, and `--config_overrides` parsing.
Imports nothing heavy (`import ran_hf` stays cheap); saved folders ship it with the config."""

import difflib
import functools
import math
import os
import typing
from typing import Literal

from huggingface_hub.dataclasses import as_validated_field
from huggingface_hub.errors import StrictDataclassError, StrictDataclassFieldValidationError


# The size check (`estimated_parameters`): a larger model is refused unless this variable raises the bound.
MAX_PARAMETERS_VARIABLE = "RAN_HF_MAX_PARAMETERS"
DEFAULT_MAX_PARAMETERS = 10**11
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")


def interval(min: float | None = None, max: float | None = None, exclude_min: bool = False, exclude_max: bool = False):
    """Transformers' `interval` validator (`transformers.utils.type_validators`, which imports the activations and
    with them Triton: `import ran_hf` stays cheap), finite values only, None passing (an unset optional field)."""
    low, high = ("(" if exclude_min else "[", ")" if exclude_max else "]")
    words = f"in {low}{min}, {max}{high}" if None not in (min, max) else f"{'>' if exclude_min else '>='} {min}"

    @as_validated_field
    def check(value):
        if value is None:
            return
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}.")
        too_low = min is not None and (value <= min if exclude_min else value < min)
        too_high = max is not None and (value >= max if exclude_max else value > max)
        if too_low or too_high:
            raise ValueError(f"must be {words}, got {value}.")

    return check


@as_validated_field
def activation_name(value: str):
    from transformers.activations import ACT2FN  # here: importing it costs about as much as Transformers

    if value not in ACT2FN:
        names = ", ".join(sorted(ACT2FN))
        raise ValueError(f"must be the name of a Transformers activation ({names}), got {value!r}.")


def expected(annotation) -> str:
    """What a field's type accepts, in words, for the error naming a value of another type."""
    words = {int: "an int", float: "a number", bool: "a bool", str: "a string", type(None): "None"}
    words[list[int]] = "a list of ints (written [2000,10000] or 2000;10000)"
    if annotation in words:
        return words[annotation]
    if typing.get_origin(annotation) is Literal:
        return f"one of {', '.join(map(repr, typing.get_args(annotation)))}"
    members = typing.get_args(annotation)
    members = [member for member in members if member is not int or float not in members]  # `float | int`: a number
    return " or ".join(dict.fromkeys(map(expected, members))) or getattr(annotation, "__name__", str(annotation))


_UNSET = object()


def value_errors(cls):
    """`@strict` raises `StrictDataclassError`; a RAN config raises `ValueError` naming the field and the value."""
    setattr_, validate = cls.__setattr__, cls.validate

    def __setattr__(self, name, value):
        state = self.__dict__
        if state.get("_post_init_done") and state.get(name, _UNSET) is value:
            # Set to what it holds: nothing changes, nothing to check. Transformers' defaults merger sets `is_causal`
            # around every forward pass.
            return
        try:
            setattr_(self, name, value)
        except StrictDataclassFieldValidationError as error:
            cause = error.__cause__
            if isinstance(cause, TypeError):
                accepted = expected(cls.__dataclass_fields__[name].type)
                raise ValueError(f"`{name}` must be {accepted}, got {value!r}.") from error
            raise ValueError(f"`{name}` {cause}") from error

    @functools.wraps(validate)
    def checked(self):
        try:
            validate(self)
        except StrictDataclassError as error:
            raise ValueError(str(error.__cause__)) from error

    cls.__setattr__, cls.validate = __setattr__, checked
    return cls


def close_field(name: str, names) -> str | None:
    """The field a name not among `names` most likely misspells (`windowsize`, `cell_pool`), or None."""
    plain = name.replace("_", "").lower()
    for field in names:
        other = field.replace("_", "").lower()
        shorter, longer = sorted((plain, other), key=len)
        if plain == other or (len(shorter) > 4 and len(longer) - len(shorter) <= 3 and longer.startswith(shorter)):
            return field
        if len(plain) > 4 and swapped_neighbours(plain, other):  # `is_casual`: difflib scores it below its cutoff
            return field
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.9)
    return close[0] if close else None


def swapped_neighbours(word: str, other: str) -> bool:
    """Whether `word` is `other` with two neighbouring letters swapped."""
    if len(word) != len(other):
        return False
    differ = [i for i, (a, b) in enumerate(zip(word, other)) if a != b]
    if len(differ) != 2 or differ[1] != differ[0] + 1:
        return False
    first, second = differ
    return word[first] == other[second] and word[second] == other[first]


def check_new_name(config, name: str) -> None:
    """`RANConfig.__setattr__`: a new name that is no attribute but looks like a field (`config.windowsize = 3`) is
    refused, as `@strict` refuses unknown fields; other new names pass, as Transformers and its integrations attach
    their own."""
    fields = config.__dataclass_fields__
    if name not in fields and not name.startswith("_") and name not in config.__dict__:
        close = None if hasattr(type(config), name) else close_field(name, list(fields))
        if close is not None:
            raise ValueError(f"`{name}` is not a field of RANConfig (did you mean {close!r}?).")


def parse_override(annotation, text: str):
    """One `--config_overrides` value read as the type `annotation` accepts (a string where nothing else reads it:
    setting it then names the type expected)."""
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


def estimated_parameters(config, **sizes) -> int:
    """About how many parameters (within a few percent) a `RANModel` of this config holds, task heads aside;
    `sizes` replace fields of `SIZE_FIELDS`. Pure arithmetic: nothing is built."""
    values = {name: sizes.get(name, getattr(config, name)) for name in SIZE_FIELDS}
    vocab, width, depth = values["vocab_size"], values["hidden_size"], values["num_hidden_layers"]
    heads = values["num_attention_heads"] * values["head_dim"]
    if config.cutoffs and config.div_val > 1 and config.cutoffs[-1] < vocab:
        bounds = [0, *config.cutoffs, vocab]
        dims = [width // config.div_val**i for i in range(len(bounds) - 1)]
        embedding = sum((high - low + width) * dim for low, high, dim in zip(bounds[:-1], bounds[1:], dims))
    else:
        embedding = vocab * width
    layer = 4 * heads * width + 4 * width * width + 3 * heads + 12 * width  # window attention, GLUs, norms
    layer += (6 * width * width + 9 * width) * config.memory_review
    layer += values["num_attention_heads"] * (width + 2) * config.associative_memory
    return embedding + depth * layer + 4 * width * width  # and the pooler


def check_size(config) -> None:
    """Refuse a config whose model would not fit any machine (`RAN_HF_MAX_PARAMETERS`), naming the field."""
    setting = os.environ.get(MAX_PARAMETERS_VARIABLE)
    try:
        bound = DEFAULT_MAX_PARAMETERS if setting is None else float(setting)
    except ValueError:
        bound = math.nan
    if not bound >= 1:
        raise ValueError(
            f"The environment variable {MAX_PARAMETERS_VARIABLE} (the most parameters a RAN config may "
            f"describe) must be a number >= 1, e.g. 1e12, got {setting!r}."
        )
    if (estimate := estimated_parameters(config)) <= bound:
        return
    # The field that, set to its default, shrinks the model most.
    defaults = {name: config.__dataclass_fields__[name].default for name in SIZE_FIELDS}
    culprit = min(SIZE_FIELDS, key=lambda name: estimated_parameters(config, **{name: defaults[name]}))
    sizes = ", ".join(f"{name}={getattr(config, name)}" for name in SIZE_FIELDS)
    raise ValueError(
        f"This config describes a model of about {estimate:.2g} parameters ({estimate * 4 / 1e9:.2g} GB in "
        f"float32), more than the bound of {bound:.2g}, mostly through `{culprit}={getattr(config, culprit)}` "
        f"({sizes}). If a model this large is meant, raise the bound with the environment variable "
        f"{MAX_PARAMETERS_VARIABLE} (e.g. {MAX_PARAMETERS_VARIABLE}={max(estimate, 1) * 10:.0e})."
    )


def apply_overrides(config, update_str: str) -> None:
    """`RANConfig.update_from_string`: set fields from `"name=value,..."`, all or none."""
    previous, given = dict(config.__dict__), set()
    try:
        for item in split_overrides(update_str):
            name, equals, text = (part.strip() for part in item.partition("="))
            if not equals or not name:
                raise ValueError(f"`{item.strip()}` is not an override: write it `name=value` (joined by commas).")
            if name in given:
                raise ValueError(f"`{name}` is given twice in the overrides {update_str!r}: give it once.")
            given.add(name)
            if not hasattr(config, name) or name.startswith("_"):
                close = difflib.get_close_matches(name, list(config.__dataclass_fields__), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"`{name}` is not a field of RANConfig{hint}.")
            field = config.__dataclass_fields__.get(name)
            # A RAN field by its type; Transformers' (annotated as strings) and properties by their value's.
            typed = field is not None and not isinstance(field.type, str)
            annotation = field.type if typed else type(getattr(config, name))
            setattr(config, name, parse_override(annotation, text))
        config.validate()
    except ValueError:
        config.__dict__.clear()
        config.__dict__.update(previous)
        raise


# The fix a refused edit names, by its rule (`configuration_ran.EDIT_RULES`): what works for that kind of field.
REFUSED_FIXES = {
    "build anew": (
        "every weight's shape follows it, so no trained weight fits `{name}={value!r}`. Build a new model from the "
        "config and train it (`{model}(config)`)."
    ),
    "keep matching weights": (
        "the shapes of some weights follow it. Set `{name}` back to {built!r}, save the model, and load it with "
        "`{model}.from_pretrained(folder, {name}={value!r}, ignore_mismatched_sizes=True)`: the weights whose shape "
        "changed start new (train them), the others are kept. Or build a new model from the config and train it "
        "(`{model}(config)`)."
    ),
    "resize": (
        "the token embedding and the output layer hold one row per id. Call `model.resize_token_embeddings({value!r})` "
        "instead: it keeps the trained rows, adds new ones and sets `{name}`."
    ),
    "load with it": (
        "its modules were made for `{name}={built!r}`, and would run or save half-changed. Set `{name}` back to "
        "{built!r}, save the model, and load it with `{model}.from_pretrained(folder, {name}={value!r})`: the trained "
        "weights in modules built with it (weights it adds start new). Or build a new model from the config "
        "(`{model}(config)`)."
    ),
}
# Heads that run in one mode whatever `is_causal` says (they run on a copy of the config set so).
ONE_MODE_HEADS = {"RANForCausalLM": True, "RANForPrefixLM": False}


def check_built(config, snapshot: tuple, names: tuple, rules: dict, model_name: str, num_labels: int | None) -> tuple:
    """`RANConfig.check_built`: `snapshot` holds the values of the fields `names` when the model was built, `rules`
    what an edit of each may do (`EDIT_RULES`), `num_labels` the scores of the model's classifier (None: none)."""
    if num_labels is not None and config.num_labels != num_labels:
        raise ValueError(labels_changed(config, model_name, num_labels))
    values = config.snapshot()
    for name, built, value in zip(names, snapshot, values):
        if built != value and rules[name].startswith("refused: "):
            built, value = (list(item) if isinstance(item, tuple) else item for item in (built, value))  # `cutoffs`
            raise ValueError(refused_edit(rules[name].removeprefix("refused: "), name, built, value, model_name))
    try:
        config.validate()
    except ValueError as error:
        message = f"The model's config was changed after the model was built and is not valid: {error}"
        raise ValueError(message) from error
    return values


def refused_edit(kind: str, name: str, built, value, model_name: str) -> str:
    """The error for `name` set from `built` to `value` on a built `model_name`: the fix `REFUSED_FIXES[kind]`."""
    if name == "is_causal" and model_name in ONE_MODE_HEADS:
        runs = "always runs causal" if ONE_MODE_HEADS[model_name] else "never runs causal"
        other = "an encoder's head" if ONE_MODE_HEADS[model_name] else "`RANForCausalLM`"
        fix = (
            f"{model_name} {runs}. To read its trained weights in the other mode, save the model and load it with "
            f"`RANModel.from_pretrained(folder, is_causal={value!r})` or {other}."
        )
    else:
        fix = REFUSED_FIXES[kind].format(name=name, built=built, value=value, model=model_name)
    return (
        f"`{name}` was changed from {built!r} to {value!r} after the model was built: {fix} To keep this model as it "
        f"is, set `{name}` back to {built!r}."
    )


def labels_changed(config, model_name: str, built: int) -> str:
    """The error for a classifier of `built` scores whose config now names `config.num_labels` labels."""
    count = config.num_labels
    labels = f"{count} label{'s' if count != 1 else ''}"
    return (
        f"`num_labels` was changed from {built} to {count} (`id2label` names {count}) after the model was built: "
        f"its classifier gives {built} scores, and a folder saved so would not load. For a classifier of {labels} "
        f"that keeps this model's other weights, set `num_labels` back to {built}, save the model, and load it "
        f"with `{model_name}.from_pretrained(folder, num_labels={count}, ignore_mismatched_sizes=True)` (and the "
        f"`id2label` naming them): the classifier starts new, to be trained. Renaming the {built} labels needs an "
        f"`id2label` of {built} names only."
    )


def check_architecture(config) -> None:
    """`RANConfig.validate_architecture`: the rules between fields, then the review bounds and the size bound."""
    window, cutoffs = config.window_size, config.cutoffs
    rules = {
        f"`min_window_size` ({config.min_window_size}) must be smaller than `window_size` ({window}).": (
            config.min_window_size >= window
        ),
        f"`window_overlap` ({config.window_overlap}) must be smaller than `window_size` ({window}).": (
            config.window_overlap >= window
        ),
        f"`head_dim` must be even (rotary embedding rotates pairs), got {config.head_dim}.": config.head_dim % 2,
        "`scan_implementation` must be a cell-scan name, got ''.": not config.scan_implementation,
        "`memory_review_cells` bounds what a causal model's tokens review (and its cache keeps); the "
        "bidirectional encoder reviews every cell of its text. Set `is_causal=True` or leave it None.": (
            config.memory_review_cells is not None and not config.is_causal
        ),
        "`is_encoder_decoder=True` describes a decoder reading a separate encoder's output; a RAN is one stack "
        "(`RANForPrefixLM` reads source and target as one text). Leave it False.": config.is_encoder_decoder,
        "`associative_memory` binds what earlier windows held for later tokens of a causal model; the "
        "bidirectional encoder reads every window already. It belongs to the causal LM (`RANForCausalLM`, "
        "`run_clm.py`, `is_causal=True`): leave it False for this model.": (
            config.associative_memory and not config.is_causal
        ),
    }
    if cutoffs is not None:
        smallest = config.hidden_size // config.div_val ** len(cutoffs)
        inside = not cutoffs or 0 < cutoffs[0] <= cutoffs[-1] < config.vocab_size
        message = f"`cutoffs` must be strictly increasing ids in (0, vocab_size={config.vocab_size}), got {cutoffs}."
        rules[message] = cutoffs != sorted(set(cutoffs)) or not inside
        message = "`cutoffs` (adaptive embeddings and softmax) belong to the causal LM (`RANForCausalLM`, "
        message += "`run_clm.py`, `is_causal=True`): leave `cutoffs` None for this model."
        rules[message] = not config.is_causal
        message = f"With `div_val={config.div_val}` the last of {len(cutoffs) + 1} clusters would embed its ids in "
        message += f"hidden_size // div_val**{len(cutoffs)} = {smallest} dimensions: use fewer cutoffs or a "
        rules[message + "smaller div_val."] = config.div_val > 1 and smallest < 1
    for message, broken in rules.items():
        if broken:
            raise ValueError(message)
    check_review_bounds(config)
    check_size(config)


def check_review_bounds(config) -> None:
    """`memory_salient_cells` adds to a bounded review and ranks by salience (both editable on a trained model)."""
    if config.memory_salient_cells is not None and config.memory_review_cells is None:
        raise ValueError(
            "`memory_salient_cells` keeps salient cells beyond the last `memory_review_cells` windows, but "
            "`memory_review_cells` is None (every cell is reviewed already). Set both, or neither."
        )
    if config.memory_salient_cells is not None and not config.review_salience:
        raise ValueError(
            "`memory_salient_cells` ranks cells by the learned prior of `review_salience`, which this config "
            "turns off; a model trained without it has no ranking to keep cells by."
        )


def check_token_ids(config) -> None:
    """Special token ids are ids of the vocabulary (Transformers' own check only warns)."""
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(config, name)
        for token_id in ids if isinstance(ids, list) else [ids]:
            if token_id is not None and not 0 <= token_id < config.vocab_size:
                raise ValueError(
                    f"`{name}` ({token_id}) is outside the vocabulary [0, {config.vocab_size - 1}] "
                    f"(`vocab_size={config.vocab_size}`)."
                )


def check_label_fields(config) -> None:
    """`num_labels` and `problem_type`, which the classification heads read (also checked when one is built)."""
    problem_types = ("regression", "single_label_classification", "multi_label_classification")
    if config.problem_type not in (None, *problem_types):
        raise ValueError(
            f"`problem_type` must be one of {', '.join(map(repr, problem_types))} or None (inferred from the "
            f"labels), got {config.problem_type!r}."
        )
    if config.id2label is not None and not config.id2label:
        raise ValueError(
            "`id2label` names no label: a classification head needs a class (1 for regression). Give its labels, "
            "e.g. `id2label={0: 'negative', 1: 'positive'}`, or `num_labels`."
        )
    check_num_labels(config.num_labels)


def check_num_labels(num_labels) -> None:
    """`num_labels` as given: Transformers keeps it as `id2label`, whose length a negative count would make 0."""
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(
            f"`num_labels` must be >= 1, got {num_labels!r}: a classification head needs a class (1 for regression)."
        )
