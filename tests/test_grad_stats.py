"""The grad-statistics functions (tpamp.get_grad_norm_fp32, clip_grad_by_total_norm_fp32,
count_zeros_fp32, filter_grads_for_norm), single process: their misuse table. Their values under
TP x PP x DP are checked in tests/test_grad_stats_dist.py."""

from __future__ import annotations

import pytest
import torch
from misuse_utils import all_of, assert_every_case_refused_by_tpamp, assert_raises_naming, case_ids

import tpamp

# ---- misuse: each bad argument or loaded value raises the documented exception type, with a
# message that names the argument or key (docs/spec.md section 14); runner: tests/misuse_utils.py


def _grads():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return [p]


MISUSE_CASES = [
    # grad statistics
    ("norm-floats", lambda: tpamp.get_grad_norm_fp32([1.0, 2.0]), TypeError, ["grads_for_norm", "float"]),
    ("norm-None", lambda: tpamp.get_grad_norm_fp32(None), TypeError, ["grads_for_norm", "NoneType"]),
    ("norm-dict", lambda: tpamp.get_grad_norm_fp32({"w": torch.ones(2)}), TypeError, ["grads_for_norm", "dict"]),
    ("norm-group-int", lambda: tpamp.get_grad_norm_fp32([torch.ones(2)], grad_stats_group=3), TypeError, ["grad_stats_group", "int"]),
    ("clip-total_norm-str", lambda: tpamp.clip_grad_by_total_norm_fp32(_grads(), 1.0, "big"), TypeError, ["total_norm", "str"]),
    ("clip-total_norm-2-elements", lambda: tpamp.clip_grad_by_total_norm_fp32(_grads(), 1.0, torch.ones(2)), ValueError, ["total_norm", "shape"]),
    ("clip-max_norm-0", lambda: tpamp.clip_grad_by_total_norm_fp32(_grads(), 0.0, 1.0), ValueError, ["max_norm", "0.0"]),
    ("clip-params-floats", lambda: tpamp.clip_grad_by_total_norm_fp32([1.0], 1.0, 2.0), TypeError, ["params", "float"]),
    ("zeros-params-str", lambda: tpamp.count_zeros_fp32("weights"), TypeError, ["params", "str"]),
    ("zeros-tp-group-str", lambda: tpamp.count_zeros_fp32(_grads(), tensor_parallel_group="tp"), TypeError, ["tensor_parallel_group", "str"]),
    ("filter-params-int", lambda: tpamp.filter_grads_for_norm(5), TypeError, ["params", "int"]),
]


def test_every_case_is_refused_by_tpamp_itself():
    """Ids distinct; each case refused inside tpamp itself (tests/misuse_utils.py)."""
    assert_every_case_refused_by_tpamp(MISUSE_CASES)


@pytest.mark.parametrize("case_id,call,exc,words", MISUSE_CASES, ids=case_ids(MISUSE_CASES))
def test_misuse_raises_a_clear_error_naming_the_argument(case_id, call, exc, words):
    assert_raises_naming(case_id, call, exc, words)


# ---- norm_type -----------------------------------------------------------------------------------


def test_grad_norm_functions_reject_bad_norm_type():
    g = [torch.ones(3)]
    with pytest.raises(ValueError, match=all_of("norm_type", r"0\.5")):
        tpamp.get_grad_norm_fp32(g, norm_type=0.5)
