"""Imports flow one way: a module imports only from layers below it, and consumers never
import each other (STYLE.md section 1). Parsed with ast, so it checks every file, run or not."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import gradtap

PACKAGE = Path(gradtap.__file__).parent

# Prefixes of dotted module names (relative to gradtap) -> (layer, capability group).
LAYERS: list[tuple[str, float, str]] = [
    ("errors", 0, "base"), ("_types", 0, "base"), ("_tensorops", 0, "base"),
    ("_registry", 0, "base"), ("_text", 0, "base"), ("_version", 0, "base"), ("functional", 0, "functional"), ("examples", 0, "base"),
    ("select", 1, "select"),
    ("record", 2, "record"), ("capture", 2.5, "capture"),
    ("_explain", 3, "explain"), ("curvature", 3, "curvature"),
    ("_monitor", 3, "monitor"), ("store", 3, "monitor"),
    ("export", 3, "monitor"), ("distributed", 3, "monitor"),
    ("_samples", 2.75, "samples"),
    ("_transform", 3, "transform"), ("_per_sample", 3, "per_sample"), ("_detect", 3, "detect"),
    ("_privacy", 3, "privacy"),
    ("rules", 4, "rules"), ("integrations", 4.5, "integrations"),
    ("report", 4, "report"), ("demo", 4.5, "demo"), ("demo_spike", 4.5, "demo"), ("_watch", 4.5, "watch"), ("cli", 5, "cli"), ("__main__", 6, "cli"),
]


def classify(name: str) -> tuple[float, str]:
    for prefix, layer, group in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return layer, group
    raise AssertionError(f"gradtap.{name} is not in the layer table of tests/test_layering.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def gradtap_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("gradtap.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module_name(path).split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
                found.append("gradtap." + target if target else "gradtap")
            elif node.module and node.module.startswith("gradtap"):
                if node.module == "gradtap":
                    found += [f"gradtap.{a.name}" for a in node.names]
                else:
                    found.append(node.module)
    return found


def test_every_module_is_classified_and_imports_flow_down():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name == "":  # the facade imports everything
            continue
        layer, group = classify(name)
        for imported in gradtap_imports(path):
            target = imported.removeprefix("gradtap.")
            t_layer, t_group = classify(target)
            if t_group == group:
                continue  # inside one capability
            if t_layer >= layer:
                problems.append(f"gradtap.{name} (layer {layer}) imports {imported} (layer {t_layer})")
    assert not problems, "\n".join(problems)


def test_every_module_imports_by_its_dotted_path():
    """``import gradtap.a.b as m`` works: the module imports, and the attribute path from
    ``gradtap`` down leads to it (no public name hides a module of the same name)."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        dotted = "gradtap" + (f".{name}" if name else "")
        module = importlib.import_module(dotted)
        obj = gradtap
        for part in name.split(".") if name else []:
            obj = getattr(obj, part, None)
        if obj is not module:
            problems.append(f"{dotted}: the attribute path gives {type(obj).__name__}")
    assert not problems, "\n".join(problems)


def test_no_module_imports_the_package_root():
    """Only the facade is ``gradtap`` itself: a module that imported the root (for
    ``__version__``, say) would run every consumer's import from below them."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name == "":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                problems += [f"gradtap.{name}: import {a.name}" for a in node.names
                             if a.name == "gradtap"]
            elif isinstance(node, ast.ImportFrom) and node.module == "gradtap" and not node.level:
                problems += [f"gradtap.{name}: from gradtap import {a.name}" for a in node.names
                             if not (PACKAGE / a.name).is_dir()
                             and not (PACKAGE / f"{a.name}.py").is_file()]
    assert not problems, "\n".join(problems)
