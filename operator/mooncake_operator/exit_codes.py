"""One exit-status table for every `mooncake-operator` command (imports nothing: the CLI starts fast).

2 is Inconclusive for the commands whose status is a verdict (`canary`, `sandbox`), so no command uses 2
for anything else: usage errors and invalid input are 3 everywhere, argparse's own included.
"""

from __future__ import annotations

from typing import Final

SUCCESS: Final = 0  # canary, sandbox: Passed
FAILED: Final = 1  # canary, sandbox: a wrong or missing answer; run: the operator stopped on an error
INCONCLUSIVE: Final = 2  # canary, sandbox only: the answers may be fine, the warm path was not proven
USAGE: Final = 3  # nothing was done or judged: bad arguments, invalid input, credentials, unreachable
INTERNAL_ERROR: Final = 70  # a defect of mooncake-operator (sysexits' EX_SOFTWARE); never a verdict
INTERRUPTED: Final = 130  # 128 + SIGINT, as shells report it
TERMINATED: Final = 143  # 128 + SIGTERM

TABLE: Final = """\
exit status (the same for every command):
  0    success (canary, sandbox: passed)
  1    failed (canary, sandbox: a wrong or missing answer; run: the operator stopped on an error)
  2    inconclusive (canary, sandbox only: the warm path was not proven)
  3    usage or input error: bad arguments, an invalid file or resource, credentials that do not work,
       an API server or replica that cannot be reached; nothing was done or judged
  70   internal error (a defect of mooncake-operator; the traceback follows)
  130  interrupted (Ctrl-C); 143 terminated (SIGTERM)"""
