"""The ``zeropp train`` application, built on the library like any user's script.

``trainer`` (the training loop of one rank), ``launch`` (the launcher side: torchrun, ports, the
environment), ``runlock`` (one run per checkpoint folder), ``schedule`` (learning rates),
``metrics``, ``report`` and ``summary`` (what a run shows and writes), ``flags`` (config keys as
command-line flags), ``hf`` (Hugging Face models from local paths), ``models`` (the embedded GPT and
what a run trains), ``data`` (the embedded corpus, your own text).
"""
