"""Checks that keep bad values out of training, in three modules by concern:

* :mod:`tpamp._checks`: argument checks (numbers, devices, tensors, process groups; one family:
  TypeError for a wrong type, ValueError for a wrong value);
* :mod:`tpamp._guards`: the shared guards of the optimizer wrappers (wrapping once, the step
  guard, the cross-rank agreement of settings), with the state they keep;
* :mod:`tpamp._load`: the all-or-nothing load of the optimizer wrappers.

This module re-exports their names, so that ``from tpamp import _validation`` and
``_validation.check_int`` etc. keep working.
"""

from tpamp._checks import (  # noqa: F401
    as_float32,
    check_bool,
    check_device,
    check_f32_scale,
    check_group_member,
    check_int,
    check_loss,
    check_mapping,
    check_narrow_state_scaler,
    check_norm_type,
    check_param_names,
    check_real,
    check_tensor_list,
    tp_rank,
)
from tpamp._guards import (  # noqa: F401
    GuardState,
    agree_on_settings,
    check_new_backward,
    check_param_groups,
    check_spike_detector,
    check_step_grads,
    check_wrappable,
    gather_rows,
    guard_state,
    guard_step,
    guard_zero_grad,
    mark_settings_agreed,
    mark_wrapped,
    register_wrapper,
    reset_step_guard,
    snapshot_param_groups,
    step_grad_sources,
    wrapped_by,
)
from tpamp._load import (  # noqa: F401
    NARROW_STATE_KEYS,
    align_inner_state,
    align_saved_groups,
    check_finite,
    check_inner_optimizer_state,
    check_optimizer_state_dict,
    check_wrapper_state,
    load_inner_state,
    load_wrapper_state,
    match_saved_tensors,
)
