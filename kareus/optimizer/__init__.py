"""The optimizer: from measured partition profiles to an energy-optimal training plan.

`kareus.optimizer.mbo` searches one partition type's configuration grid (clock, comm SMs, launch
slot) with multi-pass multi-objective Bayesian optimisation; the modules beside it compose the
measured per-partition frontiers into microbatch and iteration frontiers, choose a plan for the
job's objective and implement the baselines. The package stays generic: Kareus' partitions live in
`kareus.workload`, measurement lives in `kareus.profiler`.
"""
