"""Adapters that put zeropp behind other libraries' training loops: ``integrations.transformers``
(the Hugging Face Trainer), ``integrations.lightning`` (a Lightning strategy), and what they share
(``loop``: the engine as a host loop's module, optimizer and checkpoint; ``settings``: the ZeroConfig
from the host's flags). The core never imports this package, importing ``zeropp`` imports none of the
libraries adapted here, and each adapter imports only its own library."""
