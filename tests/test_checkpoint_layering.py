"""tpamp.checkpoint sits below the optimizers: it imports no other tpamp module and reads no
private name of another object (the optimizers answer through their public
``sharded_state_dict`` / ``load_sharded_state_dict``), and every public name it had as one
module still imports from the package."""

import ast
import os

import tpamp.checkpoint

PACKAGE = os.path.dirname(os.path.abspath(tpamp.checkpoint.__file__))
# torch's own private API that the sharded views need (no public equivalent in torch 2.x)
TORCH_PRIVATE = {"_init_from_local_shards_and_global_metadata", "_process_group"}


def _sources():
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            path = os.path.join(PACKAGE, name)
            with open(path) as f:
                yield name, ast.parse(f.read(), path)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_package_imports_no_other_tpamp_module():
    bad = []
    for file, tree in _sources():
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            bad += [f"{file}:{node.lineno} {m}" for m in mods
                    if m.split(".")[0] == "tpamp" and not m.startswith("tpamp.checkpoint")]
    assert bad == []


def test_the_package_reads_no_private_name_of_another_object():
    bad = []
    for file, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls") and node.attr not in TORCH_PRIVATE:
                    bad.append(f"{file}:{node.lineno} .{node.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value)
                    and node.args[1].value not in TORCH_PRIVATE):
                bad.append(f"{file}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("tpamp.checkpoint"):
                bad += [f"{file}:{node.lineno} import {a.name}" for a in node.names
                        if _private(a.name)]
    assert bad == []


def test_the_public_names_of_the_one_module_still_import():
    names = ["CheckpointError", "save_checkpoint", "load_checkpoint", "global_view",
             "flat_range_chunks", "sharded_tensor_from_chunks", "iteration_dir",
             "read_latest_iteration", "write_latest_iteration", "TRACKER_FILENAME",
             "clean_up_interrupted_saves"]
    assert sorted(tpamp.checkpoint.__all__) == sorted(names)
    for n in names:
        assert getattr(tpamp.checkpoint, n) is not None, n
    assert tpamp.checkpoint.TRACKER_FILENAME == "latest_checkpointed_iteration.txt"
    assert issubclass(tpamp.checkpoint.CheckpointError, ValueError)
