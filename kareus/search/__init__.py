"""Multi-objective search over a discrete grid: problems, algorithms, surrogates, indicators.

Generic in the way pymoo is: a `Problem` is a grid (`SearchSpace`: an ordered clock axis, a numeric
resource axis and a categorical slot axis, indexed clock-major) and a batch measure function
returning two objectives to minimise (time, and energy of which a static-power share is removed);
the algorithms (`exhaustive`, `random`, multi-pass MBO presets) only see grid indices and
measurements. What the axes mean for a transformer's partitions, and how a point is measured, is
the profiler's business (`kareus.profiler`); this package imports nothing of Kareus but its errors.
"""
