"""The cross-entropy reference of the kernel tests (CPU interpreter and GPU): dialect/ops_training.py's
definition in float64."""
import numpy as np

IGNORE = -100  # the ignored label of the tests


def sce_reference(x, labels, ignore: int = IGNORE):
    """lse and the row losses of logits `x` [N, V] at `labels` [N], in float64."""
    x = x.astype(np.float64)
    m = x.max(1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(1))
    inside = (labels >= 0) & (labels < x.shape[1])
    picked = np.where(inside, x[np.arange(len(x)), np.clip(labels, 0, x.shape[1] - 1)], 0.0)
    return lse, np.where(labels == ignore, 0.0, lse - picked)
