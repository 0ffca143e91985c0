"""Capture is the one door to autograd: no module outside ``gradtap.capture`` touches graph
nodes, registers hooks, queues engine callbacks or reads saved tensors. Parsed with ast, so
docstrings and comments may still name these things."""

from __future__ import annotations

import ast
from pathlib import Path

import gradtap
from gradtap.capture import compat

PACKAGE = Path(gradtap.__file__).parent
CAPTURE = PACKAGE / "capture"

#: Attribute, function and imported names that reach into autograd.
FORBIDDEN = frozenset({
    "grad_fn", "next_functions",
    "register_hook", "register_prehook", "register_post_accumulate_grad_hook",
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook",
    "register_step_pre_hook", "register_step_post_hook",
    "register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
    "register_module_forward_hook", "register_module_forward_pre_hook",
    "register_module_full_backward_hook",
    "queue_callback", "_execution_engine", "_current_graph_task_id", "_current_autograd_node",
    "saved_tensors_hooks", "save_on_cpu", "get_gradient_edge",
})
#: Prefixes of such names (autograd nodes' saved tensors: ``node._saved_self``).
FORBIDDEN_PREFIXES = ("_saved_", "_raw_saved_")
_ATTR_FUNCTIONS = {"getattr", "hasattr", "setattr"}


def _forbidden(name: str) -> bool:
    return name in FORBIDDEN or name.startswith(FORBIDDEN_PREFIXES)


def autograd_uses(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """``(line, name)`` of every use of a forbidden name in ``source``: attribute access,
    a plain name, an imported name, or a constant name given to getattr/hasattr/setattr."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Attribute) and _forbidden(node.attr):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and _forbidden(node.id):
            found.append((node.lineno, node.id))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if any(_forbidden(part) for part in alias.name.split(".")):
                    found.append((node.lineno, alias.name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTR_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _forbidden(node.args[1].value)):
            found.append((node.lineno, node.args[1].value))
    return found


def test_only_capture_reaches_into_autograd():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(CAPTURE):
            continue
        for line, name in autograd_uses(path.read_text(), str(path)):
            problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not problems, ("autograd reached outside gradtap.capture (add what is needed to "
                          "capture instead):\n" + "\n".join(problems))


def test_capture_itself_is_where_those_names_live():
    # The check above looks for the right names: capture uses many of them.
    used = {name for path in CAPTURE.rglob("*.py")
            for _, name in autograd_uses(path.read_text(), str(path))}
    assert {"grad_fn", "next_functions", "register_hook", "register_prehook",
            "register_post_accumulate_grad_hook", "queue_callback"} <= used
    # torch's private engine functions are looked up by name there, in capture/compat.py.
    assert "torch._C._current_graph_task_id" in compat.APIS


def test_the_check_sees_each_kind_of_use_and_skips_docstrings_and_comments():
    source = '''
"""A docstring naming grad_fn, register_hook and node._saved_self."""
import torch
from torch._C import _current_graph_task_id  # a comment: next_functions
x = torch.ones(1, requires_grad=True) * 2
node = x.grad_fn
value = getattr(node, "_saved_self", None)
x.register_hook(print)
torch.autograd.Variable._execution_engine.queue_callback(print)
with torch.autograd.graph.saved_tensors_hooks(id, id):
    pass
'''
    assert sorted(autograd_uses(source)) == [
        (4, "_current_graph_task_id"), (6, "grad_fn"), (7, "_saved_self"),
        (8, "register_hook"), (9, "_execution_engine"), (9, "queue_callback"),
        (10, "saved_tensors_hooks")]
