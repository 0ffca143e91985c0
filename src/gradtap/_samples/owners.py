"""Which module owns each selected parameter, its rule entry, and whether a call splits by sample.

Resolved once when ``gt.per_sample`` starts: every module that directly holds a selected
parameter owns it (a tied parameter has several owners, each use is computed and summed), with
the :class:`~gradtap._samples.rule.PerSampleRule` of its type, or none (the ``torch.func``
fallback). During the forward, :func:`classify_call` tells whether one call's own record can
give per-sample gradients or the parameters need a replay of an enclosing call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.parametrize import type_before_parametrizations

from gradtap._samples.layout import CallSplit, Dim
from gradtap._samples.rule import PER_SAMPLE, PerSampleRule
from gradtap.errors import UnsupportedModuleError
from gradtap.record import flatten_tensors

__all__ = ["Owner", "batch_size_of", "check_module", "classify_call", "describe",
           "enclosing_modules", "resolve_owners", "rows"]


@dataclass
class Owner:
    """A module that directly owns selected parameters, resolved once."""

    name: str
    module: nn.Module
    direct: dict[str, str]  # parameter name relative to the module -> qualified name
    nested: dict[str, tuple[str, str]]  # descendant's relative name -> (qualified, owner name)
    entry: PerSampleRule | None  # None: the torch.func fallback
    # A parametrized tensor ("weight") -> its selected originals' relative names.
    parametrized: dict[str, list[str]] = field(default_factory=dict)
    calls: int = 0
    seen: set[str] = field(default_factory=set)

    @property
    def rule(self) -> PerSampleRule | None:
        """The entry, when it computes from ``(input, grad_out)``."""
        return self.entry if self.entry is not None and self.entry.grad is not None else None

    @property
    def pieces(self) -> PerSampleRule | None:
        """The entry, when it splits the call into linear maps instead."""
        return self.entry if self.entry is not None and self.entry.grad is None else None

    @property
    def quals(self) -> list[str]:
        """Qualified names of every selected parameter a call of this module may use."""
        nested = [q for q, _ in self.nested.values()] if self.rule is None else []
        return list(dict.fromkeys([*self.direct.values(), *nested]))


def _split(qual: str) -> tuple[str, str, str | None]:
    """``(owner, relative name, parametrized tensor)`` of a qualified parameter name.

    ``"fc.parametrizations.weight.original0"`` belongs to ``fc`` (whose forward uses the
    parametrized ``weight``), not to the ``ParametrizationList`` that stores it.
    """
    parts = qual.split(".")
    if len(parts) >= 3 and parts[-3] == "parametrizations" and parts[-1].startswith("original"):
        return ".".join(parts[:-3]), ".".join(parts[-3:]), parts[-2]
    owner, _, rel = qual.rpartition(".")
    return owner, rel, None


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _rule_for(module: nn.Module) -> PerSampleRule | None:
    """The registered entry, unless the module's class overrides the registered ``forward``."""
    rule = PER_SAMPLE.lookup(module)
    if rule is None:
        return None
    cls = type_before_parametrizations(module)
    owner = next(c for c in cls.__mro__ if c in PER_SAMPLE)
    return rule if getattr(cls, "forward", None) is getattr(owner, "forward", None) else None


def rows(t: Tensor, batch_dim: int) -> int | None:
    """The size of ``t`` along ``batch_dim``, or ``None`` when it has no such dim."""
    return t.shape[batch_dim] if t.dim() > batch_dim else None


def describe(name: str, module: nn.Module) -> str:
    """``'the model'`` or ``"'name' (Type)"``, for messages."""
    return "the model" if name == "" else f"{name!r} ({type(module).__name__})"


def resolve_owners(model: nn.Module, params: dict[str, nn.Parameter], batch_dim: int,
                   fallback: bool) -> dict[str, Owner]:
    """Every module that directly holds one of ``params`` (qualified name -> parameter)."""
    modules = dict(model.named_modules())
    module_names = {id(m): n for n, m in modules.items()}
    selected = {id(p): q for q, p in params.items()}
    owned: dict[str, dict[str, str]] = {}
    parametrized: dict[str, dict[str, list[str]]] = {}
    # Every module that holds a selected parameter owns it, so each use of a tied
    # parameter (an embedding reused as the output head) is computed and summed.
    for full, p in model.named_parameters(remove_duplicate=False):
        qual = selected.get(id(p))
        if qual is None:
            continue
        owner, rel, tensor = _split(full)
        owner = module_names[id(model.get_submodule(owner))]  # a module under two names
        owned.setdefault(owner, {})[rel] = qual
        if tensor is not None:
            rels = parametrized.setdefault(owner, {}).setdefault(tensor, [])
            if rel not in rels:
                rels.append(rel)
    owners: dict[str, Owner] = {}
    for name, direct in owned.items():
        module = modules[name]
        entry = _rule_for(module)
        if entry is None and not fallback:
            raise UnsupportedModuleError(
                f"no per-sample rule for module {name!r} of type {type(module).__name__} "
                f"(owner of {', '.join(direct.values())}), and fallback=False; supported "
                f"types (and subclasses): {', '.join(PER_SAMPLE.supported())}"
            )
        check_module(name, module, batch_dim, entry is None)
        nested = {
            q[len(name) + 1 :] if name else q: (q, o)
            for o, d in owned.items()
            if o != name and (not name or o.startswith(name + "."))
            for q in d.values()
        }
        owners[name] = Owner(name, module, direct, nested, entry, parametrized.get(name, {}))
    return owners


def enclosing_modules(model: nn.Module, owners: dict[str, Owner]) -> list[tuple[str, nn.Module]]:
    """The model, every module that encloses an owner, and every owner without a rule:
    the calls a replay can use."""
    names = {""}
    for owner in owners.values():
        parts = owner.name.split(".") if owner.name else []
        names.update(".".join(parts[:i]) for i in range(len(parts)))
        if owner.entry is None:
            names.add(owner.name)
    return [(n, m) for n, m in model.named_modules() if n in names]


def check_module(name: str, module: nn.Module, batch_dim: int, subtree: bool) -> None:
    """Refuse modules whose samples are coupled, or whose layout contradicts ``batch_dim``."""
    subs = module.named_modules() if subtree else [("", module)]
    for sub_name, sub in subs:
        entry = PER_SAMPLE.lookup(sub)
        reason = entry.check(sub) if entry is not None and entry.check is not None else None
        if reason is not None:
            where = _qualify(name, sub_name)
            inside = f" (inside {name!r}, replayed by the fallback)" if sub_name else ""
            raise UnsupportedModuleError(
                f"per-sample gradients of module {where!r} ({type(sub).__name__}){inside} are "
                f"not defined: {reason}"
            )
    entry = PER_SAMPLE.lookup(module)
    required = entry.required_batch_dim(module) if entry is not None else None
    if required is not None and required != batch_dim:
        raise ValueError(
            f"per_sample: batch_dim={batch_dim}, but module {name!r} ({type(module).__name__}) "
            f"takes inputs with the sample dim at {required}; use batch_dim={required}"
        )


def batch_size_of(who: str, args: tuple, kwargs: dict[str, Any], batch_dim: int) -> int:
    """The number of samples in one outermost call's arguments."""
    tensors = [t for _, t in flatten_tensors((args, kwargs), "a")]
    sizes = [s for s in (rows(t, batch_dim) for t in tensors) if s is not None]
    if not sizes:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or "none"
        raise ValueError(
            f"per_sample: {who} was called without a tensor argument that has the sample dim "
            f"batch_dim={batch_dim} (tensor arguments: {shapes})"
        )
    # The size most arguments have (the first one's on a tie): a shared [1, T] argument
    # or a batch-first mask next to [T, N, ...] inputs does not decide it alone.
    return max(sizes, key=lambda s: (sizes.count(s), -sizes.index(s)))


def classify_call(owner: Owner, inputs: dict[str, Tensor], outputs: dict[str, Tensor],
                  n: int | None, bd: int, split: CallSplit | None = None,
                  member: Callable[[Tensor], bool] | None = None) -> str | None:
    """Why this call's own record cannot give per-sample gradients, or ``None``.

    ``split``: the call's arguments split into samples, for a module without a rule: its
    outputs then need a row per sample where the call's layout puts them (``_samples.
    layout``; a 0-dim output, reduced over the batch, is replayed on each sample alone).
    ``member``: whether a tensor was computed from the batch (``membership``), where the
    forward was followed: a rule's input, and an output, that was not is shared by all
    samples whatever its rows (positions ``arange(T)`` with ``T == N``)."""

    def shared(key: str, t: Tensor, what: str) -> str:
        return (f"its {what} {key!r} of shape {tuple(t.shape)} is not computed from the "
                "batch (shared by all samples: positions, a table, a buffer), so its "
                "gradient does not split by sample")

    def wrong_rows(key: str, t: Tensor, what: str) -> str:
        found = rows(t, bd)
        if found is None or found == 1:
            return (f"its {what} {key!r} of shape {tuple(t.shape)} has one row for {n} "
                    "samples (shared by all of them, or one sample's own sub-call), so its "
                    "gradient does not split by sample")
        return (f"its {what} {key!r} has {found} rows along batch_dim={bd} for {n} samples "
                "(samples folded with other rows?)")

    if owner.entry is not None:
        # A rule reads the first input and needs one row per sample in it (a pieces rule
        # knows the layout of its other arguments, masks included).
        key, inp = next(iter(inputs.items()), ("input", None))
        if inp is None:
            return "it was called without a tensor argument"
        if rows(inp, bd) != n:
            return wrong_rows(key, inp, "input")
        if member is not None and not member(inp):
            return shared(key, inp, "input")
        outputs = dict(list(outputs.items())[:1])
    # A module without a rule is replayed with its arguments: those without a row per
    # sample are shared, but every output needs one.
    for path, t in outputs.items():
        if t.requires_grad and owner.entry is None and (split is not None or t.dim() == 0):
            slot = split.slot_of(path, t) if split is not None else None
            if not isinstance(slot, Dim) or slot.rows(t) == n:
                continue  # reduced over the batch, or rows of its own (packed sequences)
            if slot.dim != bd:
                found = slot.rows(t)
                return (f"its output {path!r} of shape {tuple(t.shape)} has "
                        f"{'no' if found is None else found} rows along dim {slot.dim} for {n} "
                        "samples")
        if t.requires_grad and member is not None and not member(t) and rows(t, bd) == n:
            return shared(path, t, "output")
        if t.requires_grad and rows(t, bd) != n:
            found = rows(t, bd)
            return (f"its output {path!r} of shape {tuple(t.shape)} has "
                    f"{'no' if found is None else found} rows along batch_dim={bd} for {n} "
                    "samples")
    return None
