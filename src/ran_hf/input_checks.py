"""Input checks of the RAN models (a head's labels and losses: label_checks.py).

Shapes and dtypes are checked at once, before any work. Values are gathered as `InputChecks`: tensors still on the
device. The base model's (token ids in the vocabulary, finite embeddings, a 0/1 mask, a starting cell, a prefix LM's
segments) are read by the window layout with its own sizes, in one host synchronisation, before anything is
embedded. A head's labels are its own: it reads their checks in one synchronisation (`InputChecks.read_and_judge`)
before it calls the base model. Under `torch.compile`, where reading them would break the graph, the inputs' values
are asserted on the device instead (`assert_on_device`) and the labels' are not checked; an exported graph
(`torch.export`, ONNX) checks none.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .cache_ran import CACHE_SHAPE_FIELDS, RANCache
from .configuration_ran import RANConfig


def input_batch_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int) -> tuple:
    """(batch_size, sequence_length) of the inputs, checking only what needs no look at their values."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
    for name, value in (("input_ids", input_ids), ("inputs_embeds", inputs_embeds)):
        if value is not None and not torch.is_tensor(value):
            raise ValueError(
                f"`{name}` must be a tensor, got {type(value).__name__}: pass `torch.tensor(...)`, or call the "
                'tokenizer with `return_tensors="pt"`.'
            )
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(
                f"`input_ids` must have shape (batch_size, sequence_length), got {tuple(input_ids.shape)}."
            )
        if input_ids.dtype not in (torch.long, torch.int):
            # The embedding takes int64 / int32 only: name the dtype instead of failing inside it.
            raise ValueError(f"`input_ids` must hold integer token ids (int64 or int32), got dtype {input_ids.dtype}.")
        shape = tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
            raise ValueError(
                f"`inputs_embeds` must have shape (batch_size, sequence_length, {hidden_size}), "
                f"got {tuple(inputs_embeds.shape)}."
            )
        shape = tuple(inputs_embeds.shape[:2])
    if shape[0] == 0:
        raise ValueError("Got a batch of 0 sequences: RAN needs at least one sequence.")
    if shape[1] == 0:
        raise ValueError("Got sequences of length 0: RAN needs at least one token per batch.")
    return shape


def check_exportable(past_key_values, use_cache) -> None:
    """Refuse, naming the fix, the exports that cannot give a correct graph, before any tracing fails deep inside.

    `torch.export` and ONNX's dynamo exporter trace a window layout whose sizes follow from the input's shape and
    a cell scan that is one `scan` operator (ONNX `Scan`), so the graph takes any batch size and length.
    """
    if torch.onnx.is_in_onnx_export() and not torch.compiler.is_exporting():
        raise NotImplementedError(
            "The TorchScript-based ONNX exporter would record one fixed number of windows. Export a RAN with "
            "`torch.onnx.export(..., dynamo=True)`, or `ran_hf.export_onnx(model, path)`."
        )
    if not torch.compiler.is_exporting():
        return
    if past_key_values is not None or use_cache:
        raise NotImplementedError(
            "An exported RAN reads whole texts: export a causal model with `use_cache=False` (a graph that carries "
            "the recurrent cache from call to call is not supported)."
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            "Export a RAN under `torch.no_grad()` (`ran_hf.export_onnx` does): with gradients enabled, ONNX's "
            "exporter runs the cell scan's `scan` operator in its autograd form, which it cannot convert."
        )


class InputChecks(NamedTuple):
    """Values of a forward's inputs or of a head's labels to check, still on the device, and `judge`, which raises
    on a bad one when given them as read to the host. The base model's are read by the window layout with its sizes;
    a head reads its labels' with `read_and_judge`."""

    values: torch.Tensor  # (k,) long
    judge: Callable[[list], None]

    def read_and_judge(self) -> None:
        """Read `values` to the host in one synchronisation (none for values on the CPU) and judge them. Compiled
        or exported code reads nothing: a read would break the graph (or fail an export on a data-dependent
        branch)."""
        if torch.compiler.is_compiling():
            return
        self.judge(self.values.tolist())


def check_cache(past_key_values, config, dtype: torch.dtype | None = None) -> None:
    """Refuse, naming the mismatch, a `past_key_values` this model cannot continue: a cache of another kind (a
    transformer's `DynamicCache`, legacy tuples), a `RANCache` made by a model of another shape, or one whose cells a
    model of another `dtype` (its weights') wrote."""
    if past_key_values is None:
        return
    if not isinstance(past_key_values, RANCache):
        raise TypeError(
            f"`past_key_values` must be a RANCache (what a causal RAN returns with `use_cache=True`), got "
            f"{type(past_key_values).__name__}: a RAN carries a recurrent state, not per-token keys and values. Pass "
            "the cache this model returned, or None to start a new text."
        )
    differing = [
        f"{name} {made!r} there, {config_value!r} here"
        for name in CACHE_SHAPE_FIELDS
        if (made := past_key_values.model_shape.get(name)) != (config_value := getattr(config, name))
    ]
    if differing:
        raise ValueError(
            f"`past_key_values` was made by another model ({'; '.join(differing)}): its state cannot be continued "
            "by this one. Pass the cache this model returned, or None to start a new text."
        )
    written = next((layer.cell.dtype for layer in past_key_values.layers if layer.cell is not None), None)
    if dtype is not None and written is not None and written != dtype:
        raise ValueError(
            f"`past_key_values` was written by a model in {written}, and this one computes in {dtype}: its state "
            f"cannot be continued in another dtype. Continue it with the model that wrote it (or one cast to "
            f"{written}), or pass None to start a new text."
        )


def check_cache_position(cache_position, past_key_values, new_positions: int) -> None:
    """Refuse a `cache_position` (Transformers' index of the new positions) that disagrees with what
    `past_key_values` has read: a RAN cache knows where every row stands and needs none, so one given must say the
    same (a host read, only where one is given)."""
    read = 0 if past_key_values is None else past_key_values.get_seq_length()
    expected = list(range(read, read + new_positions))
    given = cache_position.tolist() if torch.is_tensor(cache_position) else cache_position
    if given != expected:
        shown = f"{given}" if not isinstance(given, list) or len(given) <= 6 else f"[{given[0]}, ..., {given[-1]}]"
        raise ValueError(
            f"`cache_position` is {shown}, but `past_key_values` has read {read} positions, so the {new_positions} new "
            f"ones are {read}..{read + new_positions - 1}: the cache and the positions given with it disagree. A RAN "
            "cache knows where each row stands: leave `cache_position` out, or pass the cache that read the text "
            "before these tokens (a `copy.deepcopy` made then, or None for a new text)."
        )


def check_token_type_ids(token_type_ids, batch_shape: tuple, attention_mask, config: RANConfig) -> InputChecks:
    """A prefix LM's segments: shape and dtype now; whether every real token's type is 0 (source) or 1 (target),
    the source first, is returned as `InputChecks`, to be read with the inputs' checks."""
    if config.is_causal:
        raise ValueError(
            "`token_type_ids` mark the source (0) and target (1) of a prefix LM, whose source reads itself both ways; "
            "a causal model (`is_causal=True`) reads every token causally: pass no `token_type_ids`."
        )
    if not torch.is_tensor(token_type_ids):
        raise ValueError(
            f"`token_type_ids` must be a tensor of the inputs' shape {batch_shape} (0 source, 1 target), got "
            f"{type(token_type_ids).__name__}: pass `torch.tensor(...)`."
        )
    if tuple(token_type_ids.shape) != batch_shape:
        raise ValueError(
            f"`token_type_ids` must have the inputs' shape {batch_shape}, got {tuple(token_type_ids.shape)}."
        )
    if attention_mask is not None and tuple(attention_mask.shape) != batch_shape:
        # A prefix LM reads whole texts (no cache): its mask covers exactly its inputs, as `token_type_ids` do.
        raise ValueError(
            f"`attention_mask` must have the inputs' shape {batch_shape}, as `token_type_ids` do (1 for real tokens, "
            f"0 for padding), got {tuple(attention_mask.shape)}. Pass the mask that was made with these `input_ids` "
            "(the tokenizer's, or the collator's)."
        )
    if token_type_ids.is_floating_point() or token_type_ids.is_complex():
        raise ValueError(
            f"`token_type_ids` must hold integers (0 source, 1 target), got dtype {token_type_ids.dtype}."
        )
    types = token_type_ids.long()
    real = torch.ones_like(types, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    real = real.to(types.device)
    is_target = (types == 1) & real
    unknown = (~is_target & (types != 0) & real).any()
    source_after_target = (torch.cummax(is_target.long(), dim=-1).values.bool() & (types == 0) & real).any()

    def judge(found: list) -> None:
        if found[0]:
            raise ValueError("`token_type_ids` holds a value other than 0 (source) and 1 (target) at a real token.")
        if found[1]:
            raise ValueError(
                "`token_type_ids` puts a source token (0) after a target token (1): a prefix LM's text is its source, "
                "then its target."
            )

    return InputChecks(torch.stack([unknown, source_after_target]).long(), judge)


ADDITIVE_MASK_HINT = (
    "An additive mask (0 for tokens, a large negative number for padding) must be turned into 0/1 first: "
    "`(mask == 0)`."
)


def assert_on_device(config: RANConfig, input_ids, attention_mask, inputs_embeds) -> None:
    """The value checks of `validate_ran_inputs` for compiled code: `torch._assert_async` fails the call when the graph
    runs, with the same words but without the bad value (on CUDA as a device-side assert), and reads nothing back,
    so the graph does not break."""
    if input_ids is not None:
        in_vocabulary = ((input_ids >= 0) & (input_ids < config.vocab_size)).all()
        torch._assert_async(in_vocabulary, f"`input_ids` holds a token id outside [0, {config.vocab_size - 1}].")
    else:
        assert_float_input(inputs_embeds, "inputs_embeds", config.hidden_size)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        binary = ((attention_mask == 0) | (attention_mask == 1)).all()
        message = f"`attention_mask` must hold 1 for real tokens and 0 for padding. {ADDITIVE_MASK_HINT}"
        torch._assert_async(binary, message)


def validate_ran_inputs(
    config: RANConfig,
    input_ids,
    attention_mask,
    inputs_embeds,
    past_positions: int = 0,
    shape: tuple | None = None,
) -> tuple[tuple[int, int], InputChecks | None]:
    """Fail fast, naming the problem, on inputs that would otherwise crash deep inside or silently turn into NaN.

    Shapes are checked now. The values (token ids in the vocabulary, finite embeddings, a 0/1 mask) are returned as
    `InputChecks`, which the window layout reads with its sizes before any other work on the device. Under
    `torch.compile` they are asserted on the device instead (`assert_on_device`), in an export not at all (no
    checks returned). Returns (batch_size, sequence_length) and the checks. `shape`: the inputs' `input_batch_shape`,
    where the caller has it already.
    """
    shape = shape or input_batch_shape(input_ids, inputs_embeds, config.hidden_size)
    if torch.compiler.is_compiling():
        config.validate_architecture()  # what compiled code checks; an eager forward checks the config in the model
    if attention_mask is not None and not torch.is_tensor(attention_mask):
        raise ValueError(
            f"`attention_mask` must be a tensor (1 for real tokens, 0 for padding), got "
            f"{type(attention_mask).__name__}: pass `torch.tensor(...)`, or call the tokenizer with "
            '`return_tensors="pt"`.'
        )
    if attention_mask is not None and tuple(attention_mask.shape) not in (
        shape,
        (shape[0], past_positions + shape[1]),
    ):
        raise ValueError(
            f"`attention_mask` must have the shape of the inputs {shape}"
            + (f" or of the whole text so far {(shape[0], past_positions + shape[1])}" if past_positions else "")
            + f", got {tuple(attention_mask.shape)}."
        )

    if torch.compiler.is_compiling():
        # Compiled or exported: a value check read on the host would break the graph (or fail an export on a
        # data-dependent branch). Compiled, the values are asserted on the device instead.
        if not torch.compiler.is_exporting():
            assert_on_device(config, input_ids, attention_mask, inputs_embeds)
        return shape, None
    if input_ids is not None:
        checks = [input_ids.min(), input_ids.max()]
    else:
        # One NaN spreads through the window attention and the cells to every later token of its sequence.
        embeds_check = float_input_check(inputs_embeds, "inputs_embeds", config.hidden_size)
        checks = [embeds_check.values[0]]
    not_binary = None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        # Anything but 0/1 is read as "real token" where nonzero: an additive mask (0 / -10000) would be inverted.
        not_binary = (attention_mask != 0) & (attention_mask != 1)
        checks.append(not_binary.any().to(checks[0].device))

    def judge(found: list) -> None:
        if input_ids is not None:
            low, high = found[:2]
            if low < 0 or high >= config.vocab_size:
                raise ValueError(
                    f"`input_ids` holds token id {low if low < 0 else high}, outside the vocabulary "
                    f"[0, {config.vocab_size - 1}]: tokenize with the tokenizer saved with the model, or after adding "
                    "tokens call `model.resize_token_embeddings(len(tokenizer))`."
                )
        else:
            embeds_check.judge(found[:1])
        if not_binary is not None and found[-1]:
            value = attention_mask[not_binary][0].item()
            raise ValueError(
                f"`attention_mask` must hold 1 for real tokens and 0 for padding, got {value}. {ADDITIVE_MASK_HINT}"
            )

    return shape, InputChecks(torch.stack([check.long() for check in checks]), judge)


def check_step_inputs(
    config: RANConfig, vocab_size: int, input_ids, inputs_embeds, shape: tuple, weights_dtype, compiling: bool
) -> None:
    """A decoding step's token ids or embeddings (of `input_batch_shape` `shape`), checked as a forward checks them
    (`validate_ran_inputs`, whose words name a bad value): read on the CPU, where a read waits for nothing; asserted
    on the device elsewhere and when compiled, so that no step waits for the device (a bad value then fails the call
    when it runs, as in a compiled forward). The usual case, ids in the vocabulary, costs no Python call beyond this."""
    if inputs_embeds is not None:
        check_embeds_dtype(inputs_embeds, weights_dtype)
    tensor = input_ids if input_ids is not None else inputs_embeds
    if compiling:
        validate_ran_inputs(config, input_ids, None, inputs_embeds, 0, shape)  # (asserted on the device)
        return
    if tensor.device.type != "cpu":
        assert_on_device(config, input_ids, None, inputs_embeds)
        return
    if input_ids is not None:
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read
        if low >= 0 and high < vocab_size:  # (the config's, read once per edit: `StepSettings`)
            return
    validate_ran_inputs(config, input_ids, None, inputs_embeds, 0, shape)[1].read_and_judge()


def check_initial_cell(initial_cell, batch_shape: tuple, hidden_size: int, past_positions: int) -> InputChecks | None:
    """A starting cell's shape and dtype now, before any work; whether it is finite is returned as `InputChecks`,
    read with the inputs' checks (asserted on the device under `torch.compile`; not in an export)."""
    if not torch.is_tensor(initial_cell):
        raise ValueError(
            f"`initial_cell` must be a tensor of shape (batch_size, hidden_size), got {type(initial_cell)}."
        )
    expected = (batch_shape[0], hidden_size)
    if tuple(initial_cell.shape) != expected:
        raise ValueError(
            f"`initial_cell` must have shape (batch_size, hidden_size) = {expected}, one cell per sequence, got "
            f"{tuple(initial_cell.shape)}."
        )
    if not initial_cell.is_floating_point():
        raise ValueError(
            f"`initial_cell` must hold floating-point values (a cell such as an earlier call's `last_cell`), got "
            f"dtype {initial_cell.dtype}."
        )
    if past_positions:
        raise ValueError(
            f"`initial_cell` starts a text, but `past_key_values` already holds {past_positions} token(s) whose cells "
            "continue it: pass `initial_cell` with the first call only."
        )
    if torch.compiler.is_compiling():
        if not torch.compiler.is_exporting():
            assert_float_input(initial_cell, "initial_cell", hidden_size)
        return None
    return float_input_check(initial_cell, "initial_cell", hidden_size)


def float_input_bound(hidden_size: int) -> float:
    """The largest magnitude a float input (`inputs_embeds`, `initial_cell`) may hold: RAN's norms
    (`standard_normalize`) sum the squares of `hidden_size` values in float32, whatever the input's dtype, and beyond
    this bound that sum overflows: the norm then silently turns a state into zeros, or later ops into inf and NaN."""
    return math.sqrt(torch.finfo(torch.float32).max / hidden_size)


def float_input_check(tensor: torch.Tensor, name: str, hidden_size: int) -> InputChecks:
    """The one check of a float input's values: finite, and of a magnitude the norms can square
    (`float_input_bound`). Returned as `InputChecks`, read with the inputs' checks; the bad value is read only on
    the way to the error."""
    bound = float_input_bound(hidden_size)
    bad = ~float_input_within(tensor, bound)

    def judge(found: list) -> None:
        if not found[0]:
            return
        if not torch.isfinite(tensor).all():
            raise ValueError(f"`{name}` holds NaN or infinite values.")
        largest = tensor.abs().max().item()
        raise ValueError(
            f"`{name}` holds a value of magnitude {largest:.2g}, beyond {bound:.2g}: RAN's norms sum the squares of "
            f"hidden_size={hidden_size} values in float32, which overflows there (the state becomes zeros, inf or "
            "NaN). Scale it down: embeddings and cells are of order 1."
        )

    return InputChecks(bad.any().long()[None], judge)


def float_input_within(tensor: torch.Tensor, bound: float) -> torch.Tensor:
    """Whether every value of `tensor` is in [-bound, bound], as a 0-d bool tensor on its device, from its minimum
    and maximum (no copy of a long input; NaN propagates into both and fails the comparisons), compared in float32
    (a half-precision tensor would round the bound to infinity)."""
    low, high = torch.aminmax(tensor)
    return (low.float() >= -bound) & (high.float() <= bound)


def assert_float_input(tensor: torch.Tensor, name: str, hidden_size: int) -> None:
    """`float_input_check` for compiled code: asserted on the device, without the bad value."""
    bound = float_input_bound(hidden_size)
    message = f"`{name}` holds NaN, infinite values or values of magnitude above {bound:.2g} (hidden_size="
    message += f"{hidden_size})."
    torch._assert_async(float_input_within(tensor, bound), message)


def joined_checks(*checks: InputChecks | None) -> InputChecks | None:
    """Several `InputChecks` read in one synchronisation; each judge sees its own values."""
    checks = [check for check in checks if check is not None]
    if len(checks) <= 1:
        return checks[0] if checks else None
    sizes = [len(check.values) for check in checks]

    def judge(found: list) -> None:
        start = 0
        for check, size in zip(checks, sizes):
            check.judge(found[start : start + size])
            start += size

    device = checks[0].values.device
    return InputChecks(torch.cat([check.values.to(device) for check in checks]), judge)


def check_embeds_dtype(inputs_embeds: torch.Tensor | None, weights_dtype: torch.dtype) -> None:
    """`inputs_embeds` of no wider dtype than the model's weights, unless autocast casts them: narrower ones are
    promoted by the first norm, but a float64 tensor into a float32 model would fail inside the first projection,
    unnamed."""
    if inputs_embeds is None or torch.promote_types(inputs_embeds.dtype, weights_dtype) == weights_dtype:
        return
    device = inputs_embeds.device.type
    if device != "meta" and torch.is_autocast_enabled(device):
        return
    raise ValueError(
        f"`inputs_embeds` are {inputs_embeds.dtype}, but the model's weights are {weights_dtype}: pass "
        f"`inputs_embeds.to({weights_dtype})`, or cast the model (`model.to({inputs_embeds.dtype})`)."
    )
