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
from tpamp.distributed_optimizer import DistributedOptimizer
from tpamp import parallel
from tpamp import checkpoint  # save/load_checkpoint: layout-free, torch.distributed.checkpoint
from tpamp.logger import TrainingLogger
from tpamp.spikes import GradSpikeError, SpikeDecision, SpikeDetector
from tpamp.param_norms import ParamGradNormTracker
from tpamp import nonfinite
from tpamp.nonfinite import NonFiniteActivation, NonFiniteGrad, NonFiniteTracer
from tpamp import fsdp  # FSDP2 (fully_shard) + DTensor TP: fully_shard_optimizer
from tpamp.model import (
    NaiveAMPModel,
    TF32Flags,
    module_has_fp32_attr,
    parse_dtype,
    set_fp32_attr_to_module,
    tf32_enabled,
)
from tpamp.functional import residual_add, scale_mask_softmax, vocab_parallel_cross_entropy
from tpamp.amp_torch import ModelParallelGradScaler, TorchAMPLoss, TorchAMPModel, TorchAMPOptimizer
from tpamp.initialize import (
    AMPComponents,
    ApexAMPConfig,
    ApexAMPOptimizer,
    ParallelAMPConfig,
    TorchAMPConfig,
    initialize,
    parse_amp_config,
)
