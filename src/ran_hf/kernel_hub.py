"""Fast implementations attached to the plain PyTorch ones, as Transformers attaches Hub kernels
(`use_kernel_forward_from_hub` on a module class, `use_kernel_func_from_hub_with_fallback` on a function), from a
local mapping instead of the Hub: `ran_hf.kernels.KERNELS`, the fused and Triton implementations of the installed
package.

`@use_kernel_forward("RANCenteredRMSNorm")` on a module class and `@use_kernel_function("apply_interleaved_rotary")`
on a function look their name up in that mapping once, when the module is imported. Where the package's kernels are
there, the mapping's entry wraps the plain op: each call runs the fast implementation where it can run (the rules,
and the reason of every fallback, logged once, are in `ran_hf.kernels.choice`), the plain one elsewhere. Where they
are not (a saved folder loaded with `trust_remote_code=True` on a machine without `ran_hf`), the plain implementation
is left as it is. The modeling code calls the op and never asks which implementation ran
(`ran_hf.kernels.choice.CHOSEN` says).
"""

import functools

from transformers.utils import logging


logger = logging.get_logger(__name__)

# Absolute and in a `try`: a saved folder's copy of this module takes the installed package's kernels, and
# Transformers' `check_imports` does not ask for `ran_hf` before it loads the folder's code. Importing the mapping
# registers and changes nothing in the model.
try:
    from ran_hf.kernels import KERNELS
except ModuleNotFoundError as error:
    if error.name not in ("ran_hf", "ran_hf.kernels"):  # there, and broken: say so rather than run slowly
        raise
    logger.info("`ran_hf` is not installed: RAN runs its plain PyTorch implementations (no fused or Triton kernel).")
    KERNELS = {}


def use_kernel_function(name: str):
    """Attach the kernel `name` of the mapping to the decorated function (or method): each call runs the
    implementation the kernel chooses for its arguments, the decorated one where none can run. Without the kernel,
    the function as it is."""

    def attach(plain):
        with_kernel = KERNELS.get(name)
        return plain if with_kernel is None else functools.wraps(plain)(with_kernel(plain))

    return attach


def use_kernel_forward(name: str):
    """`use_kernel_function(name)` on the decorated module class's `forward`. The class names itself
    (`kernel_layer_name`, on the class itself: a subclass, such as an adapter's wrapper, is not it), which kernels
    that read its weights past its call check."""

    def attach(cls):
        cls.kernel_layer_name = name
        cls.forward = use_kernel_function(name)(cls.forward)
        return cls

    return attach
