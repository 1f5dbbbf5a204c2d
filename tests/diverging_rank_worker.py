"""`run_classification.py` whose loss is NaN on rank 1 only, run by `tests/test_distributed.py` under
`torchrun --nproc_per_node 2`; takes run_classification.py's flags.

The NaN is added to the loss as a constant, outside the graph: rank 1's gradients stay finite, so rank 0 sees a finite
loss and, after DDP averages them, finite gradients. Only rank 1 can tell that the run diverged.
"""

import os
import sys
from pathlib import Path

import torch


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS / "text-classification")]

import run_classification  # noqa: E402
from ran_trainer import RANTrainer  # noqa: E402


compute_loss = RANTrainer.compute_loss


def loss_nan_on_rank_one(self, model, inputs, *args, **kwargs):
    loss = compute_loss(self, model, inputs, *args, **kwargs)
    if int(os.environ["RANK"]) == 1:
        loss = loss + torch.tensor(float("nan"), device=loss.device)
    return loss


RANTrainer.compute_loss = loss_nan_on_rank_one

if __name__ == "__main__":
    run_classification.main()
