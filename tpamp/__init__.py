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
