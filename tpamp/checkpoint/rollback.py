"""Host copies of everything a load may change, to put it back exactly when the commit fails
part-way on any rank.
"""

from __future__ import annotations

import copy
from typing import List, Tuple

import torch

from tpamp.checkpoint.layout import is_dtensor, local_part, local_parts
from tpamp.checkpoint.optimizers import inner_optimizer

__all__ = ["Rollback"]

Tensor = torch.Tensor


def _host_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


class Rollback:
    """Host copies of everything a load may change (model params, main params, the inner
    optimizer's state and param groups, scaler, spike detector), to restore it exactly when
    the commit fails part-way on any rank. Tensors are restored into the same objects."""

    def __init__(self, model_params, osd, optimizer, scaler, detector):
        self.tensors: List[Tuple[Tensor, Tensor]] = []
        for p in model_params.values():
            loc = local_part(p)
            self.tensors.append((loc, _host_copy(loc)))
        for v in (osd or {}).get("main_params", {}).values():
            for part in local_parts(v):
                self.tensors.append((part, _host_copy(part)))
        self.inner = inner_optimizer(optimizer) if optimizer is not None else None
        if self.inner is not None:
            # a plain tensor is restored into the same object; anything else is a deep copy
            self.state = [
                (p, {k: ("copy", v, _host_copy(v)) if isinstance(v, Tensor) and not is_dtensor(v)
                     else ("object", None, copy.deepcopy(v)) for k, v in st.items()})
                for p, st in self.inner.state.items()
            ]
            self.groups = [
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                for g in self.inner.param_groups
            ]
        self.scaler = scaler
        self.scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.detector = detector
        self.detector_state = copy.deepcopy(detector.state_dict()) if detector is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.tensors:
                live.copy_(saved)
            if self.inner is not None:
                self.inner.state.clear()
                for p, st in self.state:
                    restored = {}
                    for k, (how, obj, saved) in st.items():
                        if how == "copy":
                            obj.copy_(saved)
                            restored[k] = obj
                        else:
                            restored[k] = saved
                    self.inner.state[p] = restored
                for g, saved in zip(self.inner.param_groups, self.groups):
                    for k in [k for k in g if k != "params" and k not in saved]:
                        del g[k]
                    g.update(saved)
        if self.scaler is not None:
            self.scaler.load_state_dict(self.scaler_state)
        if self.detector is not None:
            self.detector.load_state_dict(self.detector_state)
