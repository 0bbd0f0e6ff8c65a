"""The training workload: model shapes, the per-layer op graph, partitions and pipeline stages."""
