"""What runs inside the worker process. Importing this package imports nothing
of llama.cpp; daemon.worker.__main__ does, once the process has started."""
