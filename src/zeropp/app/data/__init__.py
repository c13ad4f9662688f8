"""What ``zeropp train`` reads: the embedded corpus and its batches (:mod:`~zeropp.app.data.batches`),
your own text (:mod:`~zeropp.app.data.text`)."""
