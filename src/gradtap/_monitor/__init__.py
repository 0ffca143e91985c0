"""The Monitor's implementation (public as ``gradtap.Monitor``).

* :mod:`~gradtap._monitor.monitor`   the Monitor: construction, hooks, one step, queries
* :mod:`~gradtap._monitor.options`   kinds, default statistics, the checks of the options
* :mod:`~gradtap._monitor.step`      one computed step as one pipeline: gather, reduce,
  collective, one host copy, rows, sinks
* :mod:`~gradtap._monitor.rows`      series ids and a step's columnar rows (``StepRows``)
* :mod:`~gradtap._monitor.sinks`     ``StepSink``, where the rows go; the history is the first
* :mod:`~gradtap._monitor.trackers`  ``log_to=``: the live trackers, one sink behind a queue
* :mod:`~gradtap._monitor.reducer`   which statistics of which tensors, one host copy per step
* :mod:`~gradtap._monitor.scaler`    the grad scaler: unscaled gradients, scale and overflow
* :mod:`~gradtap._monitor.sharded`   FSDP2: local shards, EWMA layouts, summaries over shards
* :mod:`~gradtap._monitor.snapshots` kinds ``update`` and ``grad_cosine``
* :mod:`~gradtap._monitor.ewma`      the elementwise EWMA of each parameter gradient
* :mod:`~gradtap._monitor.health`    gain, gradient noise scale and loss beside the moments
  (:mod:`~gradtap._monitor.gain`, :mod:`~gradtap._monitor.gns`)
* :mod:`~gradtap._monitor.split`     ``split=``: statistics of each slice of stacked parameters
* :mod:`~gradtap._monitor.history`   the run kept in memory (the store's API)
* :mod:`~gradtap._monitor.meta`      the run metadata
"""

from gradtap._monitor.monitor import DEFAULT_STATS, KINDS, Monitor

__all__ = ["DEFAULT_STATS", "KINDS", "Monitor"]
