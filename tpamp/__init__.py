"""tpamp: mixed-precision training for model-parallel PyTorch.

Megatron-style fp32 main params around any torch optimizer, dynamic loss scaling with hysteresis,
inf/nan detection agreed over the model-parallel group, and grad-norm clipping / zero counting
that count tensor-parallel duplicates and tied params once.
"""

from tpamp.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    LossScaleUnderflowError,
    MegatronGradScaler,
)

__version__ = "0.1.0"
from tpamp.grad_stats import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    filter_grads_for_norm,
    get_grad_norm_fp32,
)
from tpamp.optimizer import FP32Optimizer, MixedPrecisionOptimizer, StepResult
from tpamp import parallel
from tpamp.logger import TrainingLogger
