"""Per-sample gradients, their norms and batch statistics: :func:`per_sample`.

``api`` holds the verb and :class:`PerSample`, which installs the hooks and hands each event
to a collaborator: ``spec`` (the arguments, parameters and owners, resolved once; ``resolved``
keeps that resolution for the next handle on an unchanged model), ``frames``
(the calls kept for a replay), ``membership`` (which tensors of a forward were computed from
the batch, followed op by op), ``own_grad`` (``own_grad=True``'s detached calls and their
share of ``.grad``), ``accumulate`` (one backward's results and their sum), ``check`` (the
sum check) and ``replays``. ``owners`` resolves which module owns each selected parameter
and its rule entry; ``compute`` turns one record into the quantities asked; ``units`` holds
the kept calls and the comparison of each backward's split; ``fallback`` replays calls under
``torch.func``; ``results`` assembles what is read. Rule entries (``rule.PerSampleRule``, one
per layer family) live in ``rules/`` and are registered in ``rules/__init__.py``; users
register their own through ``gradtap.rules``.
"""

from gradtap._per_sample import rules  # noqa: F401  (registers every built-in rule)
from gradtap._per_sample.api import PerSample, Quantity, per_sample

__all__ = ["PerSample", "Quantity", "per_sample"]
