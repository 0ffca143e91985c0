"""``gradtap watch``: monitor an unmodified training script's optimizers.

* :mod:`~gradtap._watch.launch`: the command line's side (start the script, wait, reports);
* :mod:`~gradtap._watch.site`: the start-up code every Python process of the script runs
  (standard library only, as ``sitecustomize``);
* :mod:`~gradtap._watch.child`: the Monitors inside the script's process.
"""
