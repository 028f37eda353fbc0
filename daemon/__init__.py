"""Dormouse: a model-serving daemon that sleeps when idle.

The daemon process never imports llama.cpp; the model lives in a worker
process (daemon.worker) that the supervisor spawns and tears down.
"""

__version__ = "0.1.0"
