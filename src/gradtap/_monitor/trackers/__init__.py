"""The Monitor's live trackers: each logged step's values in the tracker the user watches.

* :mod:`.keys`     the slash-path keys of the run's series (``grad/norm/fc.weight``)
* :mod:`.summary`  what a logged step becomes, once for every tracker (at most 64 keys)
* :mod:`.queue`    the trackers as one ``StepSink``, behind a bounded queue and a thread
* :mod:`.resolve`  ``log_to=`` objects (and ``--log-to`` specs) as trackers
* one adapter per tracker: :mod:`.tensorboard`, :mod:`.wandb_run`, :mod:`.mlflow_run`,
  :mod:`.lightning_logger`, :mod:`.function` (each tracker's package used only when given)
"""
