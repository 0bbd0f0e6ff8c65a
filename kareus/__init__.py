"""Kareus: energy-optimal distributed training.

The core package is pure: job spec, model workload, simulated GPU, profiler, optimizer and plan.
It imports no Kubernetes client, opens no sockets at import time and keeps no global state; the
operator, the node daemon and the CLI are thin shells around it.
"""

__version__ = "0.1.0"
