"""Bridges to other libraries, each imported only when used (they need optional packages).

* :mod:`gradtap.integrations.hf_models`: build a Hugging Face ``transformers`` model from a
  config in code (no download) and a small dummy input for it (``gradtap explain --hf``).
* :mod:`gradtap.integrations.lightning`, :mod:`gradtap.integrations.transformers`:
  ``GradtapCallback``, a Monitor per optimizer step inside a Lightning ``Trainer`` or a Hugging
  Face ``Trainer`` (what they share is in ``_callback``).
"""
