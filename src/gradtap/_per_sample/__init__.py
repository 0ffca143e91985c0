"""Per-sample gradients, their norms and batch statistics: :func:`per_sample`.

``api`` holds the verb and :class:`PerSample`; ``owners`` resolves which module owns each
selected parameter and its rule entry; ``compute`` turns one record into the quantities
asked; ``units`` keeps enclosing calls for a replay and checks each backward's split;
``fallback`` replays calls under ``torch.func``; ``results`` assembles what is read. Rule
entries (``rule.PerSampleRule``, one per layer family) live in ``rules/`` and are registered
in ``rules/__init__.py``; users register their own through ``gradtap.rules``.
"""

from gradtap._per_sample import rules  # noqa: F401  (registers every built-in rule)
from gradtap._per_sample.api import PerSample, Quantity, per_sample

__all__ = ["PerSample", "Quantity", "per_sample"]
