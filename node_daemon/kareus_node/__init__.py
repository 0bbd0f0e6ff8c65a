"""`kareus_node`: the privileged node agent that sets GPU clocks for training pods, safely.

Training pods have no NVML privileges; they ask this daemon — over TCP on the node's address with
their projected ServiceAccount token, or over a Unix socket — to lock their GPUs' SM clocks
(`kareus.daemon_client` is their side). The daemon checks who is asking (the token's TokenReview,
or kernel peer credentials → cgroup → pod; then the kubelet's GPU allocation), enforces the node policy
(clock floor/ceiling per GPU model, allowed namespaces, dry-run), journals every lease before it
locks anything, and puts GPUs back to default clocks whenever the owner goes away — the client
disconnects or is killed, its pod disappears, the daemon is stopped or restarted. It exports per-GPU
power, energy, clock and lock metrics for Prometheus.

Modules: `identity` (who is calling), `kubeapi`, `pods` and `podresources` (what the cluster says),
`auth` (may they), `config` (policy file), `journal` (what we locked), `worker` (applying clocks),
`server` (sessions, leases, the protocol), `metrics`, `main` (the command line).
"""
