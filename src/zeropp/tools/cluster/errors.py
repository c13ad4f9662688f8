"""The cluster's two ways of stopping: a one-line refusal or failure, and an interrupting signal."""

from __future__ import annotations

import signal

from zeropp.errors import ZeroppError


class ClusterError(ZeroppError, RuntimeError):
    """A refusal or a failure to build the cluster, in one line. `code` is the CLI's exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class ClusterInterrupted(BaseException):
    """SIGTERM or SIGHUP arrived during a run (SIGINT raises KeyboardInterrupt); cleanup has run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
