"""The per-sample engine, below every consumer that needs per-sample gradients.

``gt.per_sample`` (``gradtap._per_sample``) is its public verb; ``gt.detect(...,
samples=True)`` names the samples behind an anomaly with it; any other consumer that needs
each sample's gradient (clipping it, say) shares it rather than importing either of them.

Two levels:

* :class:`~gradtap._samples.engine.PerSample` (``engine``) follows a model's forward and
  backward and gives each selected parameter's per-sample gradients, norms and batch
  statistics. It installs the hooks and hands each event to a collaborator: ``spec`` (the
  arguments, parameters and owners, resolved once; ``resolved`` keeps that resolution for the
  next handle on an unchanged model), ``frames`` (the calls kept for a replay),
  ``membership`` (which tensors of a forward were computed from the batch, followed op by op),
  ``own_grad`` (``own_grad=True``'s detached calls and their share of ``.grad``),
  ``accumulate`` (one backward's results and their sum), ``check`` (the sum check) and
  ``replays``.
* :mod:`~gradtap._samples.calls`: one recorded call's per-sample gradients or squared norms
  (``call_compute``), and which rows of a tensor hold a non-finite value (``bad_rows``),
  for a consumer that already holds the records.

``clipped`` gives a clipping consumer each parameter's squared per-sample norms and its
coefficient-weighted sum ``sum_n c_n g_n`` from closed forms (``PerSample(book=Book())``),
without per-sample gradients where a layer has one.

``owners`` resolves which module owns each selected parameter and its rule entry;
``compute`` turns one record into the quantities asked; ``units`` holds the kept calls and
the comparison of each backward's split; ``fallback`` replays calls under ``torch.func``;
``results`` assembles what is read. Rule entries (``rule.PerSampleRule``, one per layer
family) live in ``rules/`` and are registered in ``rules/__init__.py``; users register their
own through ``gradtap.rules``.
"""

from gradtap._samples import rules  # noqa: F401  (registers every built-in rule)
