"""A service for the listening-socket tests (`python -m tests.launch.listen_child`): it
serves on the socket inherited as ``LISTEN_CHILD_FD`` and answers every connection with
its name (``LISTEN_CHILD_NAME``) and pid, one line."""
