import json
import os
import sys
import time
from pathlib import Path

from tests.launch.warm_child import IMPORTED_IN

if report := os.environ.get("WARM_CHILD_REPORT"):
    state = {"pid": os.getpid(), "imported_in": IMPORTED_IN, "argv": sys.argv,
             "env": dict(os.environ), "stdin": sys.stdin.read()}  # fmt: skip
    Path(report + ".tmp").write_text(json.dumps(state))
    os.replace(report + ".tmp", report)
if (message := os.environ.get("WARM_CHILD_RAISE")) is not None:
    raise ValueError(message)
if (code := os.environ.get("WARM_CHILD_EXIT")) is not None:
    sys.exit(int(code))
while True:
    time.sleep(1)
