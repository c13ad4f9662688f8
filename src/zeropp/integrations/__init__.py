"""Adapters that put zeropp behind other libraries' training loops (``integrations.transformers``:
the Hugging Face Trainer). The core never imports this package, and importing ``zeropp`` imports none
of the libraries adapted here."""
