"""Every design field acts on every decoding path: one full forward, token by token, in chunks and `generate()`.

The test walks RANConfig's own fields: a boolean is flipped, a choice tries each value, and every other field is
placed in one of the tables below (a field added later and placed nowhere fails `test_every_config_field_is_walked`,
so it is covered from the day it is added). Each variant is read on three bases: plain, with window overlap, and with
window overlap and a bounded memory. Dtypes, left-padded rows shorter than the overlap, hooks and the compiled step
have cases of their own.
"""

import typing

import pytest
import torch
from ran_testing import randomize_, tiny_config
from torch import nn

from ran_hf import RANCache, RANConfig, RANForCausalLM
from ran_hf.configuration_ran import RAN_FIELDS


TOLERANCE = 1e-4  # float32

# Fields that are not booleans or choices, with the values the walk tries (beside the causal default).
VALUED = {
    "window_size": [3, 4],
    "min_window_size": [1, 3],
    "window_overlap": [1, 3],
    "memory_review_cells": [1, 3],
    "memory_salient_cells": [1],  # (with a bounded memory: `memory_review_cells` 2)
    "scan_implementation": ["reference", "fused"],
    "hidden_act": ["gelu", "relu"],
    "rope_parameters": [{"rope_type": "default", "rope_theta": 77.0}],
    "layer_norm_eps": [1e-3],
    "cutoffs": [[20, 40]],
    "div_val": [2],  # (with `cutoffs`)
    "associative_key_conv": [3],  # (with `associative_memory`)
    "num_hidden_layers": [1, 3],
    "num_attention_heads": [1, 4],
    "head_dim": [4, 6],
}
# Fields that change no computation of a causal LM's logits, or only its size: covered by the cases above or
# elsewhere (vocabulary, token ids, dropout in inference, initialisation, classifier pooling).
NOT_WALKED = {
    "vocab_size", "hidden_size", "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
    "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "is_causal",
    "training_window_sizes",  # read by training passes alone (tests/test_training_windows.py)
}  # fmt: skip
NEEDS = {  # what a value needs beside it to make a valid config
    "memory_salient_cells": {"memory_review_cells": 2, "review_salience": True},
    "div_val": {"cutoffs": [20, 40]},
    "associative_key_conv": {"associative_memory": True},
    "associative_decay": {"associative_memory": True},
    "layer_design": {},
}
BASES = {
    "plain": {},
    "overlap": {"window_overlap": 2},
    "overlap-bounded": {"window_overlap": 2, "memory_review_cells": 2},
}


def choices(annotation) -> list | None:
    """The values a field of this annotation takes when it is a boolean or a choice, else None."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if annotation is bool or bool in args:
        return [False, True]
    literal = next((arg for arg in args if typing.get_origin(arg) is typing.Literal), None)
    if typing.get_origin(annotation) is typing.Literal:
        literal = annotation
    return list(typing.get_args(literal)) if literal is not None else None


def walked_variants() -> list:
    """(id, overrides) for every field and value the walk tries."""
    defaults = tiny_config(is_causal=True)
    variants = []
    for name in RAN_FIELDS:
        if name in NOT_WALKED:
            continue
        values = choices(RANConfig.__dataclass_fields__[name].type)
        values = values if values is not None else VALUED.get(name)
        assert values is not None, f"{name} is neither walked nor listed in NOT_WALKED"
        for value in values:
            if value == getattr(defaults, name) and not isinstance(value, bool):
                continue
            if isinstance(value, bool) and value == getattr(defaults, name):
                continue
            overrides = {**NEEDS.get(name, {}), name: value}
            variants.append((f"{name}={value}", overrides))
    return variants


def test_every_config_field_is_walked():
    walked = {overrides_id.split("=")[0] for overrides_id, _ in walked_variants()}
    assert walked | NOT_WALKED == set(RAN_FIELDS)


def build(seed=0, dtype=torch.float32, **overrides):
    model = randomize_(RANForCausalLM(tiny_config(is_causal=True, **overrides)), seed=seed)
    return model.to(dtype)


def decode(model, ids, chunk_sizes, attention_mask=None):
    """Logits of `ids` read chunk by chunk through a cache."""
    cache, logits, start = None, [], 0
    for size in chunk_sizes:
        mask = None if attention_mask is None else attention_mask[:, : start + size]
        outputs = model(ids[:, start : start + size], attention_mask=mask, past_key_values=cache, use_cache=True)
        cache, start = outputs.past_key_values, start + size
        logits.append(outputs.logits)
    return torch.cat(logits, 1)


def assert_every_path_equals_the_full_forward(model, length=19, tolerance=TOLERANCE):
    ids = torch.randint(1, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        stepwise = decode(model, ids, [1] * length)
        chunked = decode(model, ids, [4, 1, 7, 1, 1, length - 14])
        prompt_then_steps = decode(model, ids, [6] + [1] * (length - 6))
    for name, logits in [
        ("token by token", stepwise),
        ("chunked", chunked),
        ("prompt, then steps", prompt_then_steps),
    ]:
        error = (logits.double() - full.double()).abs().max().item()
        assert error <= tolerance, f"{name}: {error:.2e} from the full forward"
    generated = model.generate(
        ids[:, :6], max_new_tokens=length - 6, do_sample=False, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        full_generated = model(generated.sequences).logits[:, 5:-1]
    error = (torch.stack(generated.logits, 1).double() - full_generated.double()).abs().max().item()
    tolerance = max(tolerance, 1e-6)  # generate() hands on its logits in float32, whatever the model's dtype
    assert error <= tolerance, f"generate(): {error:.2e} from the full forward of what it generated"


@pytest.mark.parametrize("base", list(BASES), ids=list(BASES))
@pytest.mark.parametrize("overrides", [v for _, v in walked_variants()], ids=[i for i, _ in walked_variants()])
def test_every_field_acts_alike_on_every_decoding_path(overrides, base):
    combined = {**BASES[base], **overrides}
    if "window_size" in overrides or "min_window_size" in overrides:
        combined["window_overlap"] = min(combined.get("window_overlap", 0), combined.get("window_size", 5) - 1)
    if combined.get("memory_salient_cells") and base != "overlap-bounded":
        combined.setdefault("memory_review_cells", 2)
    assert_every_path_equals_the_full_forward(build(**combined))


@pytest.mark.parametrize("overrides", [{}, {"window_overlap": 3}, {"window_overlap": 3, "memory_review_cells": 2}])
def test_float64_decoding_equals_the_full_forward_with_long_windows(overrides):
    """Window plus overlap of 15 keys and more: attention's bias in float32 beside float64 queries was wrong there."""
    model = build(dtype=torch.float64, window_size=13, **overrides)
    assert_every_path_equals_the_full_forward(model, length=41, tolerance=1e-9)


def test_bfloat16_decoding_stays_near_the_full_forward():
    model = build(dtype=torch.bfloat16, window_overlap=2)
    assert_every_path_equals_the_full_forward(model, tolerance=0.15)


@pytest.mark.parametrize("overrides", [{"window_overlap": 3}, {"window_overlap": 3, "memory_review_cells": 1}])
def test_batched_generate_with_left_padded_rows_shorter_than_the_overlap(overrides):
    model = build(**overrides)
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 0, 0, 0, 9]])
    mask = (ids > 0).long()
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for row in range(2):
        alone = model.generate(ids[row : row + 1, mask[row].argmax() :], max_new_tokens=12, do_sample=False,
                               pad_token_id=0)  # fmt: skip
        assert torch.equal(batched[row, mask[row].argmax() :], alone[0])


def test_a_step_with_another_number_of_rows_than_its_cache_is_refused():
    model = build()
    ids = torch.randint(1, 61, (2, 7))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="rows"):
            model(ids[:1, :1], past_key_values=cache)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"input_ids": torch.tensor([[61]])}, "vocab"),
        ({"input_ids": torch.tensor([[1.0]])}, "integer"),
        ({"input_ids": torch.tensor([[[1]]])}, "input_ids"),
        ({"inputs_embeds": torch.full((2, 1, 16), float("nan"))}, "NaN|finite"),
        ({"inputs_embeds": torch.zeros(2, 1, 15)}, "16|hidden_size"),
    ],
    ids=["id-out-of-range", "float-ids", "3d-ids", "nan-embeds", "wrong-width-embeds"],
)
def test_a_step_checks_its_input_as_the_forward_does(inputs, message):
    model = build()
    ids = torch.randint(1, 61, (2, 7))
    cache = model(ids, use_cache=True).past_key_values
    if "input_ids" in inputs and inputs["input_ids"].shape[0] == 1 and inputs["input_ids"].dim() == 2:
        inputs = {"input_ids": inputs["input_ids"].expand(2, 1)}
    with torch.no_grad():  # where one-token calls take the step branch
        with pytest.raises(ValueError, match=message):
            model(**inputs, past_key_values=cache)
        torch.testing.assert_close(  # and the cache is as it was
            model(ids[:, -1:] * 0 + 3, past_key_values=cache).logits,
            model(torch.cat([ids, ids[:, -1:] * 0 + 3], 1)).logits[:, -1:],
        )


@pytest.mark.parametrize(
    "module_name, steers",
    [
        ("layers.0", True),
        ("layers.0.memory_review", True),
        ("layers.0.window_attention", True),
        ("layers.1.qkv_proj", True),
        # The scan's outputs feed the recurrence of later steps, not of a whole pass: a hook on them sees every
        # step, but steering them is not the same edit in both.
        ("layers.0.cell_scan", False),
    ],
)
def test_a_forward_hook_acts_on_decoding_steps_as_on_the_full_forward(module_name, steers):
    """A steering hook on a layer's module is called in every step and changes steps and the full forward alike."""
    model = build(window_overlap=1)
    module = model.model.get_submodule(module_name)
    calls = []

    def steer(module, args, output):
        calls.append(1)
        if not steers:
            return None
        if isinstance(output, torch.Tensor):
            return output * 1.5
        return (output[0] * 1.5, *output[1:])

    ids = torch.randint(1, 61, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids).logits
    handle = module.register_forward_hook(steer)
    try:
        with torch.no_grad():
            full = model(ids).logits
            calls.clear()
            stepwise = decode(model, ids, [1] * 13)
    finally:
        handle.remove()
    assert len(calls) >= (13 if module_name != "layers.0.cell_scan" else 2), f"{module_name}'s hook missed steps"
    if steers:
        assert (full - plain).abs().max() > 1e-3  # the hook changes the logits ...
        assert (stepwise - full).abs().max() <= TOLERANCE  # ... of the steps as of the full forward


def test_a_step_runs_the_attention_implementation_set_since_the_last_step():
    """A step looks window attention's function up by the name the config held at its last check: an implementation
    set between two steps runs in the next one, and gives its logits."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counted_attention(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("ran_test_counted", counted_attention)
    model = build(window_overlap=1)
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :5], use_cache=True).past_key_values
        model.set_attn_implementation("ran_test_counted")
        steps = [model(ids[:, position : position + 1], past_key_values=cache).logits for position in range(5, 9)]
    assert len(calls) == 4 * model.config.num_hidden_layers  # every layer of every step
    assert (torch.cat(steps, 1) - full[:, 5:]).abs().max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"window_overlap": 2, "use_rotary": False},
        {"memory_review_cells": 2},
        {"associative_memory": True, "window_overlap": 2},
    ],
)
def test_a_compiled_step_equals_the_full_forward(overrides):
    model = build(**overrides)
    ids = torch.randint(1, 61, (2, 19), generator=torch.Generator().manual_seed(4))
    step = torch.compile(model, fullgraph=False, dynamic=False)
    with torch.no_grad():
        full = model(ids).logits
        cache = RANCache(model.config, max_cache_len=19)  # a compiled step cannot grow the cache: room first
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        logits = [step(ids[:, position : position + 1], past_key_values=cache).logits for position in range(6, 19)]
    assert (torch.cat(logits, 1) - full[:, 6:]).abs().max() <= TOLERANCE


def test_the_step_calls_its_submodules_as_modules():
    """No step reads a submodule's weights past its call: every module with parameters that the full forward calls
    is called in a step too (hooks, adapters and Accelerate's offload depend on it)."""
    model = build(window_overlap=1, token_shift=True, associative_memory=True)
    ids = torch.randint(1, 61, (2, 9))
    called = {"full": set(), "step": set()}
    phase = ["full"]
    handles = [
        module.register_forward_pre_hook(lambda module, args, name=name: called[phase[0]].add(name))
        for name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
        and not isinstance(module, nn.Embedding | RANForCausalLM)
    ]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        phase[0] = "step"
        model(ids[:, :1], past_key_values=cache)
    for handle in handles:
        handle.remove()
    assert called["full"] - called["step"] == set()


@pytest.mark.parametrize(
    "edit",
    [
        lambda layer: layer.update_recurrent_state(layer.cell.flip(-1)),
        lambda layer: setattr(layer, "cell_states", layer.cell_states * 0.5),
        lambda layer: layer.update_tail(layer.tail_keys * 0.5, layer.tail_values),
    ],
    ids=["cell", "cells", "tail"],
)
def test_what_eager_steps_keep_follows_any_edit_of_the_cache(edit):
    """The window and cells a step keeps for the next (`step_window`, `step_review`) are used only while the cache
    holds the state they came from: an edit between steps acts on the next step as on a cache that kept nothing."""
    model = build(window_size=6)
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = model(ids[:, :7], use_cache=True).past_key_values
        model(ids[:, 7:8], past_key_values=cache)  # a step within the window: it keeps what the next one reads
        assert all(layer.step_window is not None for layer in cache.layers)
        fresh = RANCache(model.config)
        fresh.__dict__.update({k: v for k, v in cache.__dict__.items() if k != "layers"})
        for layer, fresh_layer in zip(cache.layers, fresh.layers):
            edit(layer)
            fresh_layer.__dict__.update({k: v for k, v in layer.__dict__.items() if not k.startswith("step_")})
            fresh_layer.memo_of = None
        torch.testing.assert_close(
            model(ids[:, 8:9], past_key_values=cache).logits, model(ids[:, 8:9], past_key_values=fresh).logits
        )
