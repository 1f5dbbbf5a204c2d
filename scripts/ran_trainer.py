"""The `Trainer` the example training scripts run: `RANTrainer` (RAN's model card, an atomic final save, a stop for
runs that diverge), the stop itself as a mixin any `Trainer` takes (`StopsDivergedRuns`: `train_embeddings.py`'s
sentence-transformers trainer), and the parameter checksum callback for checking data parallelism.

Machinery shared by the example training scripts (`scripts/<task>/run_*.py`), which import it with `scripts/` on
`sys.path`.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoints import is_run_file, refuse_changed_config
from model_cards import write_model_card
from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ran_hf import RANConfig
from ran_hf.files.folders import write_folder
from ran_hf.files.recovery import discard_set_aside, retire_set_aside
from ran_hf.integrations.sentence_embeddings import write_sentence_transformers_config


logger = logging.getLogger(__name__)


# ---- non-finite values: diverged runs and broken weights ----------------------------------------------------------


class TrainingDivergedError(RuntimeError):
    """The loss or the gradients stayed NaN or infinite: the run stops instead of saving what it learned."""


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """The name of the first parameter or floating-point buffer holding a NaN or an infinity; None if all are finite.

    Under FSDP each process checks its own shard (a DTensor's local part); DeepSpeed's placeholders are empty."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        tensor = tensor.detach()
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(tensor).all():
            return name
    return None


def on_every_process(flag: torch.Tensor) -> bool:
    """Whether the boolean `flag` holds on every process of a distributed run (one all-reduce of one number; just
    `flag` in a single process). Every process must call it at the same point: a decision to stop made on one rank
    alone would leave the others waiting for it in their next collective until the run's timeout."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.int32)  # gloo and NCCL reduce integers, not bools
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


class DivergenceGuard:
    """Counts the optimizer steps in a row whose loss or gradient norm is NaN or infinite, and stops the run at
    `limit` of them.

    The losses of a step's micro-batches are combined on the device; the step is read back once (one host read per
    optimizer step). A step that fp16's loss scaler skipped for infinite gradients does not count: the weights are
    untouched and the scaler lowers its scale. Its loss still counts, since the forward pass does not depend on it.
    In a distributed run a step counts when it was non-finite on any process (each sees its own loss; without
    gradient clipping no process sees a gradient norm), so that every process stops at the same step.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.step_losses_finite = None  # all micro-batch losses of the current step finite, on the device
        self.last_loss = None
        self.bad_steps = []  # global steps of the current run of non-finite steps
        self.checked_step = None

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        finite = torch.isfinite(loss).all()
        self.step_losses_finite = finite if self.step_losses_finite is None else self.step_losses_finite & finite
        self.last_loss = loss

    def end_step(self, global_step: int, grad_norm, step_skipped: bool, device: torch.device) -> None:
        """After the optimizer step `global_step` (and before anything is logged or saved for it); `device` is the
        one this process trains on (where a distributed run reduces)."""
        if global_step == self.checked_step:  # the epoch's end repeats the last step's logging call
            return
        self.checked_step = global_step
        finite = torch.ones((), dtype=torch.bool, device=device)
        if self.step_losses_finite is not None:
            finite = finite & self.step_losses_finite.to(device)
        if grad_norm is not None and not step_skipped:
            finite = finite & torch.isfinite(torch.as_tensor(grad_norm, device=device)).all()
        self.step_losses_finite = None
        if on_every_process(finite):
            self.bad_steps = []
            return
        self.bad_steps.append(global_step)
        if len(self.bad_steps) >= self.limit:
            loss = "unknown" if self.last_loss is None else f"{self.last_loss.float().mean().item():g}"
            norm = "not computed" if grad_norm is None else f"{float(grad_norm):g}"
            count, first = len(self.bad_steps), self.bad_steps[0]
            if count > 1:
                steps = f"{count} optimizer steps in a row, steps {first} to {global_step}"
            else:
                steps = f"optimizer step {global_step}"
            raise TrainingDivergedError(
                f"Training diverged: the loss or the gradient norm was NaN or infinite at {steps} (last loss {loss}, "
                f"gradient norm {norm}). The run stops here and saves nothing more; checkpoints saved before step "
                f"{first} are kept. Lower --learning_rate, lengthen --warmup_steps or set "
                "--max_grad_norm, and resume from such a checkpoint or start again (--max_nonfinite_steps sets how "
                "many such steps in a row stop a run)."
            )


# ---- parameter checksums ------------------------------------------------------------------------------------------


def parameter_checksum(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name and float32 bytes, in `named_parameters` order (tied weights once)."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class ParameterChecksumCallback(TrainerCallback):
    """At the end of training, every process writes `{"rank", "global_step", "sha256"}` to `<folder>/rank-<N>.json`."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": args.process_index, "global_step": state.global_step, "sha256": parameter_checksum(model)}
        (self.folder / f"rank-{args.process_index}.json").write_text(json.dumps(record) + "\n")
        logger.warning(
            f"Parameter checksum of rank {args.process_index} at step {state.global_step}: {record['sha256']}"
        )


# ---- the trainer --------------------------------------------------------------------------------------------------


class StopsDivergedRuns:
    """A `Trainer` mixin (`class MyTrainer(StopsDivergedRuns, Trainer)`) that ends a diverged run after the optimizer
    step that makes it so (`DivergenceGuard`), before that step is logged, checkpointed or saved, and refuses to save
    weights that are NaN or infinite (`refuse_nonfinite_weights`, which the save must call). How many non-finite steps
    in a row stop the run: `max_nonfinite_steps`, else the training arguments' `--max_nonfinite_steps`, else 3."""

    def __init__(self, *args, max_nonfinite_steps: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        limit = max_nonfinite_steps or getattr(self.args, "max_nonfinite_steps", 3)
        self.divergence_guard = DivergenceGuard(limit)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.divergence_guard.add_loss(loss)
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs) -> None:
        """Stops a diverged run (`DivergenceGuard`) after each optimizer step, before it is logged or saved."""
        self.divergence_guard.end_step(
            self.state.global_step,
            grad_norm,
            step_skipped=self.accelerator.optimizer_step_was_skipped,
            device=self.accelerator.device,
        )
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def refuse_nonfinite_weights(self, output_dir: str | None) -> None:
        """Raise `TrainingDivergedError` when a weight holds NaN or infinite values (on any process: under FSDP each
        checks its own shard, and all must stop together). Every process must call it, as every process saves."""
        broken = first_nonfinite_weight(self.model)
        if on_every_process(torch.tensor(broken is None, device=self.accelerator.device)):
            return
        weight = f"its weight {broken}" if broken is not None else "a weight of another process's shard"
        raise TrainingDivergedError(
            f"Refusing to save the model to {output_dir or self.args.output_dir}: {weight} holds NaN or infinite "
            "values; the run diverged. Lower --learning_rate, lengthen --warmup_steps or set --max_grad_norm, and "
            "start again or resume from an earlier checkpoint."
        )


class RANTrainer(StopsDivergedRuns, Trainer):
    """`Trainer` whose model card (written by `create_model_card`, and so by `push_to_hub`) is RAN's own.

    `card` holds what only the script knows: the task, the data, intended use and limitations (see `write_model_card`).
    With `sentence_transformers_pooling`, the final save also writes sentence-transformers' files
    (`ran_hf.integrations.sentence_embeddings.write_sentence_transformers_config`) beside the model, in the same atomic step.
    """

    def __init__(self, *args, card: dict | None = None, sentence_transformers_pooling: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.card = card or {}
        self.sentence_transformers_pooling = sentence_transformers_pooling
        if sentence_transformers_pooling == "cell_transform" and not any(
            name.rsplit(".", 1)[-1] == "pooler" for name, _ in self.model.named_modules()
        ):
            raise ValueError(
                f"--sentence_transformers_pooling cell_transform needs a trained pooler, which a "
                f"{type(self.model).__name__} does not have: choose pooled_cell, mean or max."
            )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, str | Path):
            refuse_changed_config(resume_from_checkpoint, self.accelerator.unwrap_model(self.model).config)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def write_sentence_transformers_files(self, folder: str | Path) -> None:
        if self.sentence_transformers_pooling is not None:
            write_sentence_transformers_config(folder, pooling=self.sentence_transformers_pooling)

    def _save_checkpoint(self, model, trial) -> None:
        """Before a checkpoint is written: the old run's checkpoints that `--overwrite_output_dir` set aside are
        retired (never put back, not even if this run fails or is killed: `latest` must continue this run), and a
        `checkpoint-N` of the same step already there (a run resumed from an earlier checkpoint saves it again, in
        place) loses its `trainer_state.json` first, which Trainer writes last: a kill while it is rewritten leaves
        a folder that `latest` skips, never new weights beside the old optimizer and trainer state."""
        if self.args.should_save:
            retire_set_aside(self.args.output_dir)
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            (folder / TRAINER_STATE_NAME).unlink(missing_ok=True)
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The final save (into `--output_dir`) goes through `ran_hf.files.folders.write_folder`: the model is written
        into a temporary folder, which then replaces the old one (its contents, for a mount point); checkpoints and
        other entries of the old folder stay, its previous model, metrics and card do not. A full disk or a kill
        leaves the old model or the new one, whole. Checkpoint saves, other ranks and DeepSpeed saves are Transformers'
        own. Weights that are NaN or infinite are never saved."""
        self.refuse_nonfinite_weights(output_dir)
        final = output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir)
        if not final or not self.args.should_save or self.is_deepspeed_enabled:
            super().save_model(output_dir, _internal_call=_internal_call)
            return
        written = set()
        with write_folder(self.args.output_dir, "saving", carry_over=lambda name: not is_run_file(name)) as staging:
            super().save_model(str(staging), _internal_call=True)
            if any(staging.iterdir()):
                self.write_sentence_transformers_files(staging)
            written = {path.name for path in staging.iterdir()}
        if written:
            discard_set_aside(self.args.output_dir)  # the old run's checkpoints (--overwrite_output_dir)
        else:  # nothing to publish (a sharded FSDP state, say): the folder stays as it is
            super().save_model(output_dir, _internal_call=True)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, **kwargs) -> None:
        if not isinstance(self.accelerator.unwrap_model(self.model).config, RANConfig):
            # A baseline trained for comparison (a GPT-2, say): Transformers' own card.
            super().create_model_card(finetuned_from=kwargs.get("finetuned_from"))
        elif self.is_world_process_zero():
            write_model_card(self, **{**self.card, **kwargs})
