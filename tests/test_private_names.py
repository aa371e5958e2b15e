"""No tpamp module reads or writes another module's (or another object's) private names.

Every tpamp/*.py (subpackages included) is parsed with ast. A violation is:
* an attribute access ``x._name`` (read, write, call, delete) where ``x`` is not ``self``,
  ``cls`` or ``super()`` and ``_name`` is not a dunder;
* ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` of such a name given as a string;
* ``from tpamp.x import _name`` (a private function, class or constant of another module; the
  package-internal modules themselves, ``from tpamp import _checks``, may be imported).

The exceptions are torch's own internals that tpamp has no public way to reach; each entry of
ALLOWED says why. A new one needs a reason of the same kind, never a tpamp name: a tpamp module
that needs another's private state gets a public method instead.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import tpamp

ROOT = pathlib.Path(tpamp.__file__).parent

ANY = None  # any receiver
# name -> (reason, receivers as written in the source, or ANY)
ALLOWED = {
    # torch's dispatcher and op registry (tpamp._ext checks which kernels are registered)
    "_C": ("torch._C, the dispatcher: the list of registered ops", {"torch"}),
    "_dispatch_get_all_op_names": ("torch._C's list of registered op names", {"torch._C"}),
    "_schema": ("an OpOverload's schema (the signature of a registered op)", ANY),
    # torch tensors
    "_version": ("a tensor's version counter (the step guard sees an in-place change of a "
                 "grad without keeping a copy)", ANY),
    "_local_tensor": ("a DTensor's local shard (DTensor.to_local() would be differentiable "
                      "and build a new tensor)", ANY),
    # torch's foreach and amp kernels: the fallback path of tpamp.ops calls them as torch.amp does
    "_foreach_norm": ("torch's multi-tensor norm", {"torch"}),
    "_foreach_mul_": ("torch's multi-tensor in-place multiply", {"torch"}),
    "_foreach_mul": ("torch's multi-tensor multiply", {"torch"}),
    "_foreach_copy_": ("torch's multi-tensor copy", {"torch"}),
    "_amp_foreach_non_finite_check_and_unscale_": (
        "torch.amp's found_inf + unscale kernel (what GradScaler.unscale_ calls)", {"torch"}),
    # torch.nn.Module
    "_apply": ("nn.Module._apply, the one hook that casts params and buffers in place (as "
               "Module.half() does) keeping Parameter identity", ANY),
    # torch.optim: hooks and flags that an optimizer wrapper must honour as torch.optim does
    "_optimizer_step_pre_hooks": ("an Optimizer's step pre-hooks (register_step_pre_hook "
                                  "has no public reader)", ANY),
    "_optimizer_step_post_hooks": ("an Optimizer's step post-hooks", ANY),
    "_global_optimizer_pre_hooks": ("torch.optim.optimizer's global step pre-hooks",
                                    {"_torch_optimizer"}),
    "_global_optimizer_post_hooks": ("torch.optim.optimizer's global step post-hooks",
                                     {"_torch_optimizer"}),
    "_opt_called": ("the flag an LR scheduler reads to warn about scheduler.step() before "
                    "optimizer.step(); the wrapper's step sets it on the inner optimizer", ANY),
    "_wrapped_by_lr_sched": ("the marker an LR scheduler puts on Optimizer.step", ANY),
    "_step_supports_amp_scaling": ("torch.optim's flag: step() skips on a device found_inf "
                                   "(torch.amp.GradScaler reads it the same way)", ANY),
    # torch.amp.GradScaler (ModelParallelGradScaler is one)
    "_get_scale_async": ("torch.amp.GradScaler's scale without a host sync", {"self.scaler"}),
    # torch.distributed
    "_get_default_group": ("the default process group (dist.group.WORLD is a placeholder)",
                           {"dist.distributed_c10d"}),
    "_get_default_timeout": ("the backend's default collective timeout",
                             {"dist.distributed_c10d"}),
    "_get_backend": ("a ProcessGroup's backend object (its timeout has no public reader)", ANY),
    "_timeout": ("a backend's options.timeout", ANY),
    # ShardedTensor (torch.distributed._shard): no public constructor from local shards with a
    # given global metadata
    "_init_from_local_shards_and_global_metadata": ("ShardedTensor's constructor from local "
                                                    "shards and global metadata",
                                                    {"ShardedTensor"}),
    "_process_group": ("a ShardedTensor's process group", ANY),
    # Python
    "_replace": ("NamedTuple._replace, public API of collections.namedtuple", ANY),
    "_fields": ("NamedTuple._fields, public API of collections.namedtuple", ANY),
}


_ATTR_FUNCS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(receiver: ast.AST) -> bool:
    if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
        return True
    return (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super")


def _allowed(name: str, receiver: ast.AST) -> bool:
    entry = ALLOWED.get(name)
    if entry is None:
        return False
    receivers = entry[1]
    return receivers is ANY or ast.unparse(receiver) in receivers


def violations(path: pathlib.Path):
    """(file, line, what) for every private-name access of ``path`` that is not allowed."""
    rel = path.relative_to(ROOT.parent).as_posix()
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not _own(node.value) and not _allowed(node.attr, node.value):
                out.append((rel, node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTR_FUNCS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            name, receiver = node.args[1].value, node.args[0]
            if not _own(receiver) and not _allowed(name, receiver):
                out.append((rel, node.lineno,
                            f"{node.func.id}({ast.unparse(receiver)}, {name!r})"))
        elif (isinstance(node, ast.ImportFrom) and node.module
              and node.module.split(".")[0] == "tpamp" and node.module != "tpamp"):
            out.extend((rel, node.lineno, f"from {node.module} import {a.name}")
                       for a in node.names if _private(a.name))
    return out


def _files():
    return sorted(ROOT.rglob("*.py"))


def test_no_module_touches_another_modules_private_names():
    found = [v for f in _files() for v in violations(f)]
    assert found == [], "\n".join(f"{f}:{line}: {what}" for f, line, what in found)


def test_no_tpamp_attribute_is_put_on_other_objects():
    """The guards once wrote ``_tpamp_*`` attributes onto the wrappers and the torch optimizer;
    their state now lives in tpamp._guards."""
    found = [(f.relative_to(ROOT.parent).as_posix(), node.lineno, node.value)
             for f in _files() for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith("_tpamp_")]
    found += [(f.relative_to(ROOT.parent).as_posix(), node.lineno, node.attr)
              for f in _files() for node in ast.walk(ast.parse(f.read_text()))
              if isinstance(node, ast.Attribute) and node.attr.startswith("_tpamp_")]
    assert found == []


@pytest.mark.parametrize("source,expected", [
    ("other._x", ["other._x"]),
    ("self._x; cls._y; super()._z; obj.__dict__", []),
    ("x._replace(a=1)", []),  # allowed anywhere (NamedTuple API)
    ("foo._get_scale_async()", ["foo._get_scale_async"]),  # allowed on self.scaler only
    ("torch._foreach_norm(xs)", []),
    ("np._foreach_norm(xs)", ["np._foreach_norm"]),
    ("getattr(opt, '_remainders', {})", ["getattr(opt, '_remainders')"]),
    ("setattr(opt, '_tpamp_x', 1)", ["setattr(opt, '_tpamp_x')"]),
    ("getattr(self, '_x', None)", []),
    ("from tpamp.ops import _force_fallback", ["from tpamp.ops import _force_fallback"]),
    ("from tpamp import _checks", []),
])
def test_the_checker_itself(tmp_path, source, expected):
    pkg = tmp_path / "tpamp"
    pkg.mkdir()
    f = pkg / "m.py"
    f.write_text(source + "\n")
    global ROOT
    old, ROOT = ROOT, pkg
    try:
        assert [what for _, _, what in violations(f)] == expected
    finally:
        ROOT = old


# ---- module structure: shared helpers have a named home, no import cycle -------------------------


def _tpamp_imports(path, *, lazy: bool):
    """(module, names) of every ``from tpamp... import`` in a file (lazy: also inside functions)."""
    import ast

    tree = ast.parse(open(path).read())
    nodes = ast.walk(tree) if lazy else tree.body
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tpamp"):
            names = [a.name for a in node.names]
            if node.module == "tpamp":  # from tpamp import ops, _validation: modules
                out.extend((f"tpamp.{n}", []) for n in names)
            else:
                out.append((node.module, names))
    return out


def _tpamp_files():
    import pathlib

    return sorted((pathlib.Path(tpamp.__file__).parent).glob("*.py"))


def test_no_module_imports_another_modules_private_names():
    """Private (_underscore) functions, classes and constants stay in their module; shared ones
    live under public names (tpamp.common, tpamp._checks, tpamp._guards, tpamp._load). The
    package-internal modules themselves (tpamp._validation, tpamp._ext) may be imported."""
    bad = [(f.name, mod, n) for f in _tpamp_files() for mod, names in _tpamp_imports(f, lazy=True)
           for n in names if n.startswith("_")]
    assert bad == []


def test_no_import_cycle_between_tpamp_modules():
    """Module-level and lazy imports alike: grad_stats -> _validation -> common, never back."""
    graph = {f"tpamp.{f.stem}": {m for m, _ in _tpamp_imports(f, lazy=True)} for f in _tpamp_files()}
    graph = {k: {m for m in v if m in graph and m != k} for k, v in graph.items()}
    assert "tpamp.grad_stats" not in graph["tpamp._validation"]
    assert "tpamp._validation" not in graph["tpamp.common"] and graph["tpamp.common"] == set()
    assert graph["tpamp._checks"] == set()  # the argument checks are a leaf
    assert graph["tpamp._load"] == {"tpamp._checks", "tpamp._guards", "tpamp.common",
                                    "tpamp.hyperparameters",  # the option rules: a leaf
                                    "tpamp.param_groups",  # the override keys: a leaf
                                    "tpamp.state_formats"}  # the formats: a leaf over common
    assert graph["tpamp.hyperparameters"] == set()
    assert graph["tpamp.param_groups"] == {"tpamp.hyperparameters"}
    for a in ("tpamp.grad_stats", "tpamp._validation", "tpamp._checks", "tpamp._guards",
              "tpamp._load", "tpamp.common", "tpamp.optimizer", "tpamp.distributed_optimizer",
              "tpamp.param_norms", "tpamp.spikes", "tpamp.grad_scaler", "tpamp.amp_init"):
        seen, todo = set(), list(graph[a])
        while todo:  # everything a reaches must not reach a again
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        assert a not in seen, f"{a} imports itself through {sorted(seen)}"
