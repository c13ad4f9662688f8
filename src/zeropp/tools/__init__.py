"""Tools off the training path: ``zeropp estimate`` (:mod:`~zeropp.tools.estimate`), ``zeropp cluster``
(:mod:`~zeropp.tools.cluster`, emulated nodes), ``zeropp bench`` (:mod:`~zeropp.tools.bench`)."""
