"""kvpage changes no code of transformers: an AST scan of python/kvpage for what would (a forward or
method assigned onto an object, types.MethodType, setattr, an assignment into a module imported from
transformers, a class swap). Selecting its own forward is the runner's explicit call (llama.py)."""
import ast
from pathlib import Path

import kvpage

PACKAGE = Path(kvpage.__file__).resolve().parent
# setattr that replaces a child module of the model by a tensor-parallel shard of it (the model's
# structure, which the generic path runs; no code of transformers changes).
ALLOWED_SETATTR = {("model/tensor_parallel.py", "_set_submodule")}


def _transformers_names(tree: ast.Module) -> set[str]:
    """Names a file binds to transformers or anything imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("transformers")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _functions(tree: ast.Module):
    """(enclosing function name or None, node) for every node."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            yield inner, child
            yield from visit(child, inner)
    yield from visit(tree, None)


def _patches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    relative = path.relative_to(PACKAGE).as_posix()
    imported = _transformers_names(tree)
    found = []
    for function, node in _functions(tree):
        where = f"{relative}:{getattr(node, 'lineno', '?')}"
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in ("forward", "__class__") and _root(target) != "self":
                found.append(f"{where}: assigns .{target.attr}")
            elif isinstance(target, ast.Attribute) and _root(target) in imported:
                found.append(f"{where}: assigns into {_root(target)} (imported from transformers)")
        if isinstance(node, ast.Attribute) and node.attr == "MethodType":
            found.append(f"{where}: types.MethodType")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and (relative, function) not in ALLOWED_SETATTR):
            found.append(f"{where}: setattr")
    return found


def test_kvpage_patches_nothing_of_transformers():
    found = [p for path in sorted(PACKAGE.rglob("*.py")) for p in _patches(path)]
    assert not found, "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The scan itself: each pattern in a scratch file is reported."""
    source = ("import types\nfrom transformers.models.llama import modeling_llama\n"
              "def f(layer, g):\n    layer.forward = g\n    modeling_llama.apply_rotary_pos_emb = g\n"
              "    layer.self_attn.forward = types.MethodType(g, layer)\n    setattr(layer, 'forward', g)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    (tmp_path / "patch.py").write_text(source)
    found = _patches(tmp_path / "patch.py")
    assert len(found) == 5, found
