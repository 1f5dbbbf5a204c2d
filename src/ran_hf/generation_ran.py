"""How `generate()` drives a causal RAN's recurrent cache (`RANGenerationMixin`, `RANForCausalLM`'s): the cache is
a `RANCache` with room for what compiled steps write, its rows repeat with the inputs' for beam search, every step
after the prompt is the last token and the cache alone (the model's step branch, decode_step.py), and what a
recurrent state cannot do, drafting for assisted generation, is refused before any forward."""

import torch
from transformers import GenerationMixin

from .cache_ran import RANCache


def check_prompt_after_cache(cache: RANCache, prompt_length: int) -> None:
    """`generate()` given a cache and the whole text so far (its mask as long as its ids) reads only the positions
    after those the cache has read: refuse a text no longer than the cache, whose tokens it would read again."""
    read = cache.get_seq_length()
    if read >= prompt_length:
        raise ValueError(
            f"`past_key_values` has already read {read} positions, but `generate()` was given {prompt_length}: a "
            "cache continues the text it read, so the ids given with it must be that text and what follows it. Pass "
            "a fresh cache (or None), continue a copy made before its first use (`copy.deepcopy(cache)`), or pass "
            "only the new tokens with the attention mask of the whole text."
        )


class RANGenerationMixin(GenerationMixin):
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        # As another model's draft (`assistant_model=`), the RAN would draft tokens the main model then rejects, and
        # its cache cannot drop them: refused at the draft's first call, before either model runs a forward.
        if getattr(generation_config, "is_assistant", False):
            raise ValueError(
                f"{type(self).__name__} cannot draft for assisted generation (`assistant_model=`): the main model "
                "rejects some drafted tokens, and a recurrent cache that has read them cannot be cropped back. "
                "Generate with the main model alone, or draft with a model whose cache can be cropped."
            )
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # RAN keeps a recurrent state, not per-token keys and values: forward() creates its own `RANCache`.
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):  # fmt: skip
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
        cache = model_kwargs.get("past_key_values")
        # Room for every cell this call can write, where its steps are compiled (a graph cannot grow the cache). Eager
        # steps grow it as they go (`prepare_inputs_for_generation`): memory follows what is generated, not what
        # `max_new_tokens` allows.
        if isinstance(cache, RANCache) and self._valid_auto_compile_criteria(model_kwargs, generation_config):
            cache.reserve(max_cache_length)

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None,
                                      **model_kwargs):  # fmt: skip
        # Beam search and `num_return_sequences` repeat every row `expand_size` times; a returned cache the call
        # continues holds one state per original row, repeated the same way (Transformers expands tensors only).
        cache = model_kwargs.get("past_key_values")
        if isinstance(cache, RANCache) and cache.is_initialized and expand_size > 1:
            rows = (input_ids if input_ids is not None else model_kwargs["inputs_embeds"]).shape[0]
            if cache.batch_size == rows:
                cache.batch_repeat_interleave(expand_size)
        return super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **model_kwargs)

    # What `generate` hands a step that a decoding step leaves out: the mask (see below), and what the prompt's pass
    # read once (`initial_cell`) or a causal RAN does not take.
    _NOT_STEP_INPUTS = ("attention_mask", "initial_cell", "labels", "position_ids", "token_type_ids")

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, inputs_embeds=None, next_sequence_length=None, **kwargs
    ):
        continues = isinstance(past_key_values, RANCache) and past_key_values.is_initialized
        if continues and kwargs.get("is_first_iteration") and next_sequence_length is not None:
            check_prompt_after_cache(past_key_values, (input_ids if inputs_embeds is None else inputs_embeds).shape[1])
        if next_sequence_length == 1 and continues and not kwargs.get("is_first_iteration"):
            # A decoding step, as Mamba's: the last token and the cache. `generate` extends the attention mask with
            # ones, so the new tokens are all real, and the cache knows where each row stands; without the mask the
            # step reads nothing to the host.
            past_key_values.reserve(input_ids.shape[1])  # room for the cells a compiled step writes
            model_inputs = {
                "input_ids": input_ids[:, -1:].clone(memory_format=torch.contiguous_format),  # fixed strides
                "past_key_values": past_key_values,
            }
            kwargs.pop("is_first_iteration", None)
            for key, value in kwargs.items():
                if key not in self._NOT_STEP_INPUTS:
                    model_inputs[key] = value
            return model_inputs
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            next_sequence_length=next_sequence_length, **kwargs,
        )  # fmt: skip
        if isinstance(past_key_values, RANCache) and past_key_values.is_initialized:
            model_inputs.pop("initial_cell", None)  # read by the prompt's pass; the cache carries the cells since
        return model_inputs

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        # RAN reads the 2D padding mask (its windows are causal by construction); no 4D mask is built for a
        # compilable cache.
        return attention_mask
