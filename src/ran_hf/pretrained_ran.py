"""What every RAN model shares (`RANPreTrainedModel`): a config edited after building is checked before the model
runs or saves; weights load with an older layout's names refused and a damaged file named, and save through guarded
writes; modules start from `_init_weights`; and a forward handed a cache completes or leaves it as it was
(`cache_transaction`)."""

import functools
import inspect
import os

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import auto_docstring

from .adaptive_softmax import RANClusterBiases
from .associative_memory import RANAssociativeMemory
from .building_blocks import RANTokenShift
from .cache_ran import RANCache
from .configuration_ran import RANConfig
from .decode_step import decodes_in_steps, step_settings
from .files.safe_writes import hub_repo, write_into
from .files.weight_files import check_no_old_cell_weights, checkpoint_weight_names, damaged_weights_error
from .memory_review import RANMemoryReview
from .ran_layer import RANLayer, RANWindowAttention


def changed_after_build(model_name: str, name: str, built, value) -> str:
    """The error for a field the model was built from, set from `built` to `value` on its config."""
    load = f"set it back, save the model and load it with `{model_name}.from_pretrained(folder, {name}={value!r}"
    if name == "vocab_size":
        fix = f"call `model.resize_token_embeddings({value!r})` instead: it keeps the trained rows and sets it"
    elif name == "hidden_size":  # every weight's shape follows it: no trained weight carries over
        fix = f"no trained weight fits it; build a new model from the config (`{model_name}(config)`) and train it"
    elif name == "is_causal" and model_name in ("RANForCausalLM", "RANForPrefixLM"):
        mode = "always runs causal" if model_name == "RANForCausalLM" else "never runs causal"
        fix = f"{model_name} {mode}; for the other mode, load its folder with `RANModel.from_pretrained(folder, "
        fix += f"is_causal={value!r})` or a head of that mode"
    elif name in ("num_attention_heads", "head_dim", "cutoffs", "div_val", "num_labels"):  # some weights' shapes
        fix = f"{load}, ignore_mismatched_sizes=True)`: the weights it reshapes start new (train them), the others "
        fix += f"are kept; or build a new model from the config (`{model_name}(config)`)"
    else:
        fix = f"{load})`: the trained weights in modules built with it (weights it adds start new)"
    return (
        f"`{name}` was changed from {built!r} to {value!r} after the model was built, whose weights and modules were "
        f"made for {built!r}: {fix}. To keep this model as it is, set `{name}` back to {built!r}."
    )


@auto_docstring
class RANPreTrainedModel(PreTrainedModel):
    config: RANConfig
    config_class = RANConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RANLayer"]
    # Window attention runs through Transformers' attention functions: eager (returns weights) and SDPA (default).
    # Flex attention is not claimed: on CPU it has no backward and its compiled forward crashed here. The memory
    # review and the cell scan keep their own small matmuls: one key per window, or one query per step.
    _supports_sdpa = True
    # The cell scan runs window after window through the whole sequence: it cannot be split across ranks by length.
    _supports_context_parallel = False
    # Whether a head reads `token_type_ids` (the prefix LM's source and target); the others leave them out.
    reads_token_types = False
    # Transformers' output capture records these (`output_hidden_states`, `output_attentions`) from the modules that
    # compute them, as for Llama: every layer's input and output token states (B, L, D), the window attention's
    # weights where the implementation gives them, and the memory review's.
    _can_record_outputs = {
        "hidden_states": RANLayer,
        "attentions": RANWindowAttention,
        "memory_attentions": RANMemoryReview,  # its output's second item, as for attention modules
    }

    def post_init(self):
        super().post_init()
        self._built_from = self.built_fields()  # a forward or save after one of these changed is refused
        self._checked_key = None  # (config, its edit count) when last checked: unchanged since, nothing to check
        self.checked_config = None  # a token of that check, which the caches it checked carry
        self.decodes_in_steps = False  # whether one-token calls take the step branch, as last checked (decode_step.py)
        self.step_settings = None  # what a step reads of the config, as last checked

    def built_fields(self) -> dict:
        """What this model's weights and modules were made from: the config's `architecture_fields`, and a
        classifier's number of scores."""
        built = {name: getattr(self.config, name) for name in self.config.architecture_fields}
        return built | ({"num_labels": self.num_labels} if hasattr(self, "num_labels") else {})

    def check_config(self):
        """After an edit of the config (its edit count changed; compiled code skips this): refuse to run or save if a
        field the model was built from changed, naming the fix; validate the config; renew what modules hold a copy
        of (dropout rates, the embedding's padding index), so that such an edit takes effect at once."""
        config = self.config
        # (its own dict, read past Transformers' `__getattribute__`, which runs two Python calls a read)
        checked = (id(config), object.__getattribute__(config, "__dict__").get("edits"))
        if checked == self._checked_key:
            return
        for name, built in self._built_from.items():
            if (value := getattr(config, name)) != built:
                raise ValueError(changed_after_build(type(self).__name__, name, built, value))
        try:
            config.validate()
        except StrictDataclassError as error:  # (its cause names the field or the rule)
            message = f"The model's config was changed after the model was built and is not valid: {error.__cause__}"
            raise ValueError(message) from error
        for module in self.modules():
            if type(module).__module__.rpartition(".")[0] != __name__.rpartition(".")[0]:
                continue  # another library's modules keep their own rates (LoRA's dropout)
            if isinstance(getattr(module, "dropout", None), nn.Dropout):
                module.dropout.p = config.hidden_dropout_prob
            if isinstance(getattr(module, "attention_dropout", None), (int, float)):
                module.attention_dropout = config.attention_probs_dropout_prob
        if type(embeddings := self.get_input_embeddings()) is nn.Embedding:  # only the padding row's gradient reads it
            embeddings.padding_idx = config.pad_token_id
        self._checked_key, self.decodes_in_steps = checked, decodes_in_steps(config)
        self.step_settings = step_settings(config)
        self.checked_config = object()  # what a cache this model checks is marked with (`RANCache.checked_by`)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Transformers' `save_pretrained`. A path that is a file is refused (Transformers logs a line and saves
        nothing)."""
        if os.path.isfile(save_directory):
            raise NotADirectoryError(
                f"{save_directory} is a file: `save_pretrained` writes a folder (config, weights, code). Give the path "
                "of a folder, new or existing."
            )
        self.check_config()
        with write_into(save_directory) as staging:  # safe_writes.py: no link in the folder is written through
            kwargs = hub_repo(save_directory, kwargs.get("push_to_hub", False), kwargs)
            return super().save_pretrained(staging, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        # Cast or moved (`.to`, `.half()`), the model checks the caches it is handed again (`check_cache`).
        self._checked_key = None
        return super()._apply(fn, *args, **kwargs)

    def resize_token_embeddings(self, *args, **kwargs):
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        for module in self.modules():  # `vocab_size` now matches the resized embedding
            if isinstance(module, RANPreTrainedModel):
                module._built_from, module._checked_key = module.built_fields(), None
        return embeddings

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs):
        """Transformers' loading (`from_pretrained`, the Auto classes), with a damaged weights file named:
        safetensors' own error ("incomplete metadata, file not fully covered" for a file that a full disk or an
        interrupted copy cut short) does not say which file it read. Weights under old cell names are refused before
        any is read (`check_no_old_cell_weights`)."""
        source = "The state dict" if state_dict is not None else ", ".join(map(str, checkpoint_files or ())) or "It"
        check_no_old_cell_weights(checkpoint_weight_names(state_dict, checkpoint_files), source)
        try:
            return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs)
        except SafetensorError as error:
            raise damaged_weights_error(checkpoint_files or [], error) from error

    def load_state_dict(self, state_dict, *args, **kwargs):
        # Old cell weight names would be "unexpected" to torch, and silently dropped with `strict=False`.
        check_no_old_cell_weights(state_dict, "The state dict")
        return super().load_state_dict(state_dict, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, RANLayer) and hasattr(module, "initial_cell"):
            # Not zero (what the official initialiser amounts to): the cell is standardised on reading, and a zero
            # vector's standardisation has gradient 1 / sqrt(eps) ~ 3e3 (its memory-review key, a unit vector of
            # zero, far more). At initialisation that gradient was 100-1e8 times all the others together, so
            # clipping by the global norm left every other weight almost no update. Converted checkpoints load theirs.
            init.normal_(module.initial_cell, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, RANMemoryReview):
            if hasattr(module, "salience"):
                init.zeros_(module.salience)  # no cell is preferred before training says which are worth reading
            if hasattr(module, "log_scale"):
                init.ones_(module.log_scale)
        elif isinstance(module, RANTokenShift):
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, RANAssociativeMemory):
            init.ones_(module.read_scale)  # a read that is there to be learned from (associative_memory.py)
            if hasattr(module, "key_conv"):  # the identity: each key as it is, until training mixes in its neighbours
                init.zeros_(module.key_conv)
                init.ones_(module.key_conv[0])
            if module.decays:  # heads from 1e-4 to 1e-2 per token: some keep a fact long, some forget soon
                rates = torch.logspace(-4, -2, module.num_heads, dtype=torch.float64)
                init.copy_(module.decay_bias, torch.log(torch.expm1(rates)))  # softplus^-1
        elif isinstance(module, RANClusterBiases):
            for bias in module:
                init.zeros_(bias)


def cache_transaction(forward):
    """A forward handed a `RANCache` completes or leaves it as it was: its layers update the cache one after another,
    and a failure in a later one (or in the loss, or an interrupt) would leave the earlier ones a step ahead. Every
    update replaces a tensor (none is written into where a later step reads it), so a copy of the attributes (and of
    the base layer's per-state dicts) restores it; a head's call covers its base model's."""
    position = list(inspect.signature(forward).parameters).index("past_key_values")  # `self` included

    @functools.wraps(forward)
    def transaction(*args, **kwargs):
        cache = kwargs.get("past_key_values", args[position] if len(args) > position else None)
        if type(cache) is not RANCache or "saved" in vars(cache) or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        owners = (cache, *cache.layers)
        cache.saved = list(map(dict, map(vars, owners)))  # (C calls only: a decoding step runs this too)
        for saved in cache.saved:
            for name, value in saved.items():
                if type(value) is dict:  # the base layer's per-state dicts, written in place
                    saved[name] = dict(value)
        try:
            return forward(*args, **kwargs)
        except BaseException:
            for owner, saved in zip(owners, cache.saved):
                vars(owner).clear()
                vars(owner).update(saved)
            raise
        finally:
            vars(cache).pop("saved", None)

    return transaction
