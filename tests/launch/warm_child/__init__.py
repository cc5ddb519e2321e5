"""A child for the warm-start tests (`python -m tests.launch.warm_child`): it reports how
it was started to the file ``WARM_CHILD_REPORT`` names, then raises ValueError with the
message ``WARM_CHILD_RAISE``, exits with ``WARM_CHILD_EXIT`` or sleeps until signalled."""

import os

IMPORTED_IN = os.getpid()  # a warm child runs in another process than the one that imported it
