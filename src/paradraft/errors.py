"""The one base class of errors a user can fix.

Every error that bad input, an impossible flag or an output paradraft will not touch can cause derives from
`UserError`; the CLI prints those as one line naming the flag or path. Any other exception is a bug and keeps its
traceback (`PARADRAFT_DEBUG=1` shows the traceback of a UserError too).
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix (bad input, a flag out of range, an output that is not paradraft's to replace)."""


class Paused(Exception):
    """Not an error: a run stopped at its time limit with everything saved; the same command continues it. The CLI
    prints it as one line and exits with PAUSED_EXIT (EX_TEMPFAIL: try again)."""


PAUSED_EXIT = 75


class DataError(UserError, ValueError):
    """Input data that cannot be used (no usable samples, a directory that is not what a flag needs)."""
