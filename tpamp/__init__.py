"""tpamp: mixed-precision training for model-parallel PyTorch.

Megatron-style fp32 main params around any torch optimizer, dynamic loss scaling with hysteresis,
inf/nan detection agreed over the model-parallel group, and grad-norm clipping / zero counting
that count tensor-parallel duplicates and tied params once.
"""

__version__ = "0.2.0"

from tpamp import (
    checkpoint,  # save/load_checkpoint: layout-free, torch.distributed.checkpoint
    fsdp,  # FSDP2 (fully_shard) + DTensor TP: fully_shard_optimizer
    nonfinite,
    parallel,
    replicas,
)
from tpamp.amp_init import (
    AMPComponents,
    ApexAMPConfig,
    ApexAMPOptimizer,
    ParallelAMPConfig,
    TorchAMPConfig,
    initialize,
    parse_amp_config,
)
from tpamp.amp_torch import ModelParallelGradScaler, TorchAMPLoss, TorchAMPModel, TorchAMPOptimizer
from tpamp.distributed_optimizer import DistributedOptimizer
from tpamp.functional import residual_add, scale_mask_softmax, vocab_parallel_cross_entropy
from tpamp.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    LossScaleUnderflowError,
    MegatronGradScaler,
    ScalerSnapshot,
)
from tpamp.grad_stats import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    filter_grads_for_norm,
    get_grad_norm_fp32,
    is_expert_param,  # mixture-of-experts (docs/spec.md section 19)
    mark_expert_param,
)
from tpamp.layerwise_optimizer import LayerWiseDistributedOptimizer
from tpamp.logger import TrainingLogger
from tpamp.matrix_optimizers import (  # Muon / Adafactor under TP: docs/spec.md section 17
    CombinedOptimizer,
    TensorParallelAdafactor,
    TensorParallelMuon,
    check_sharded_math,
    declare_elementwise,
    is_elementwise_optimizer,
    muon_with_adamw,
    split_muon_params,
)
from tpamp.model import (
    NaiveAMPModel,
    TF32Flags,
    module_has_fp32_attr,
    parse_dtype,
    set_fp32_attr_to_module,
    tf32_enabled,
)
from tpamp.nonfinite import (
    ExpertNonFiniteGrad,  # an expert param's record (docs/spec.md section 19)
    NonFiniteActivation,
    NonFiniteGrad,
    NonFiniteTracer,
)
from tpamp.optimizer import FP32Optimizer, MixedPrecisionOptimizer, StepResult
from tpamp.param_groups import ParamGroupOverride, ParamKey, build_param_groups
from tpamp.param_norms import ParamGradNormTracker
from tpamp.spikes import GradSpikeError, SpikeDecision, SpikeDetector

__all__ = [
    "AMPComponents",
    "ApexAMPConfig",
    "ApexAMPOptimizer",
    "build_param_groups",
    "checkpoint",
    "check_sharded_math",
    "CombinedOptimizer",
    "declare_elementwise",
    "is_elementwise_optimizer",
    "muon_with_adamw",
    "split_muon_params",
    "TensorParallelAdafactor",
    "TensorParallelMuon",
    "clip_grad_by_total_norm_fp32",
    "ConstantGradScaler",
    "count_zeros_fp32",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "ExpertNonFiniteGrad",
    "filter_grads_for_norm",
    "FP32Optimizer",
    "fsdp",
    "get_grad_norm_fp32",
    "GradSpikeError",
    "initialize",
    "LayerWiseDistributedOptimizer",
    "is_expert_param",
    "LossScaleUnderflowError",
    "mark_expert_param",
    "MegatronGradScaler",
    "MixedPrecisionOptimizer",
    "ModelParallelGradScaler",
    "module_has_fp32_attr",
    "NaiveAMPModel",
    "nonfinite",
    "replicas",
    "NonFiniteActivation",
    "NonFiniteGrad",
    "NonFiniteTracer",
    "parallel",
    "ParallelAMPConfig",
    "ParamGradNormTracker",
    "ParamGroupOverride",
    "ParamKey",
    "parse_amp_config",
    "parse_dtype",
    "residual_add",
    "ScalerSnapshot",
    "scale_mask_softmax",
    "set_fp32_attr_to_module",
    "SpikeDecision",
    "SpikeDetector",
    "StepResult",
    "tf32_enabled",
    "TF32Flags",
    "TorchAMPConfig",
    "TorchAMPLoss",
    "TorchAMPModel",
    "TorchAMPOptimizer",
    "TrainingLogger",
    "vocab_parallel_cross_entropy",
]
