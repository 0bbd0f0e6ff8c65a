"""The optimizer: from a profile document to an energy-optimal training plan.

Composition turns the profile's measured per-partition frontiers into microbatch frontiers per
stage and direction (`composition`, read through a `sources.MeasurementSource`), `frontier` solves
the 1F1B iteration frontier with lowtime, `planning` applies the job's objective, and `baselines`
builds the other methods' frontiers with the same code. It reads the profile document
(`kareus.profiler.document`); nothing below it imports it.
"""
