"""How precisely can a search know the points it must measure? (issue 30, seventh pass)

`bench/mbo_efficiency.py`'s oracles say what the acceptance takes: measuring, at 20 % of the grid,
the points within about 0.25–0.5 % of the noise-free front (at random within 1 % leaves as many
searches below 99 % as the shipped search). A search can only measure a point it predicts to be
there, so this asks how well any surrogate can predict at 1 % measurement noise, with the family
that describes the twin's landscape best per parameter and the measurements in the best places.

The family: a clock curve shared by every configuration (one value per clock) plus, per
configuration, a polynomial of degree k − 1 in 1/f (k = 1: an offset; 2: offset and drift; 3: a
quadratic), fitted to log time and log effective energy by least squares. Per partition type:

- bias: the relative RMS error of the fit to the noise-free grid, over the band (points within
  `--within` of the noise-free front in either plane): what the family cannot describe;
- parameters p against the budget n (20 % of the grid): a least-squares fit of p parameters to n
  measurements at noise σ errs by about σ·√(p/n) at the measured points;
- error: the fit to the seed's noisy measurements of a design, against the truth, at the band's
  measured points and at its unmeasured ones that the measurements determine (estimable: in the
  row space of the measured rows; the share is printed; the others a fit can only guess). Designs: `oracle`, the budget's points nearest
  the noise-free front (`mbo_efficiency`'s band oracle, the best a search could have measured),
  and `default`, what the shipped search measured.

    .venv/bin/python bench/search_floor.py --seeds 2 --workers 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from mbo_efficiency import GPU, MODELS, Case, Grid, _planes, cases, grid

from kareus.search.algorithms import get_algorithm, minimize
from kareus.search.indicators import relative_gap
from kareus.search.problem import SearchSpace

DEGREES = (1, 2, 3)  # parameters per configuration
FITTED = (1, 2)  # the degrees fitted to noisy measurements (3 has 0.9-1.25 parameters per measurement)
BUDGET = 0.2  # of the grid
AXES = ("time", "effective")


def design_matrix(space: SearchSpace, per_configuration: int) -> np.ndarray:
    """Columns: one per clock (the shared clock curve), then per configuration a polynomial of
    degree `per_configuration` − 1 in standardised 1/f (the constant of the first configuration
    is the clock curve's, so it is left out)."""
    clock_i, config = space.axes[0], space.configuration_index
    inverse = 1.0 / np.asarray(space.clocks_mhz, dtype=float)[clock_i]
    inverse = (inverse - inverse.mean()) / inverse.std()
    one_hot = np.eye(space.configurations)[config]
    columns = [np.eye(len(space.clocks_mhz))[clock_i], one_hot[:, 1:]]
    columns += [one_hot * inverse[:, None] ** degree for degree in range(1, per_configuration)]
    return np.hstack(columns)


def log_values(table: np.ndarray, p_static_w: float) -> np.ndarray:
    """Columns log time and log effective energy of a (time_s, energy_j) table."""
    return np.log(np.column_stack((table[:, 0], table[:, 1] - p_static_w * table[:, 0])))


def rms_error(design: np.ndarray, fit_rows: np.ndarray, observed: np.ndarray, truth: np.ndarray,
              at: np.ndarray) -> list[float]:
    """Per axis: the relative RMS error against `truth` at rows `at` of the least-squares fit
    (minimum norm where the rows leave parameters free) to `observed` at `fit_rows`."""
    beta, *_ = np.linalg.lstsq(design[fit_rows], observed[fit_rows], rcond=None)
    residual = design[at] @ beta - truth[at]
    return [float(np.sqrt(np.mean(residual[:, axis] ** 2))) for axis in range(residual.shape[1])]


def estimable(design: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Mask: rows whose value the measured rows determine (in their row space: an estimable
    function of the linear model); the others the fit leaves to its arbitrary minimum norm."""
    basis = np.linalg.pinv(design[measured]) @ design[measured]  # projector onto the row space
    residual = np.linalg.norm(design - design @ basis, axis=1)
    return residual <= 1e-8 * np.maximum(np.linalg.norm(design, axis=1), 1.0)


def floor_case(case: Case, within: float = 0.01) -> dict:
    table: Grid = grid(case)
    space, p_static_w = table.space, table.p_static_w
    truth, noisy = log_values(table.truth, p_static_w), log_values(table.noisy, p_static_w)
    planes = _planes(table.truth[:, 0], table.truth[:, 1], p_static_w)
    gap = np.min([relative_gap(plane) for plane in planes], axis=0)
    band = np.flatnonzero(gap <= within)
    budget = int(BUDGET * space.size)
    designs = {"oracle": np.argsort(gap, kind="stable")[:budget], "default": _default_measured(table, case.seed)}
    out: dict = {"case": case.__dict__, "config": case.config, "partition": case.partition,
                 "configurations": space.configurations, "budget": budget, "band": len(band),
                 "parameters": {}, "bias": {}, "error": {}}
    everything = np.arange(space.size)
    for degree in DEGREES:
        design = design_matrix(space, degree)
        out["parameters"][degree] = int(np.linalg.matrix_rank(design))
        out["bias"][degree] = dict(zip(AXES, rms_error(design, everything, truth, truth, band), strict=True))
        if degree not in FITTED:
            continue
        for name, measured in designs.items():
            measured = np.asarray(measured)
            inside = np.isin(band, measured)
            unmeasured = band[~inside & estimable(design, measured)[band]]
            missed = int(np.count_nonzero(~inside))
            out["error"][f"{name} k={degree}"] = {
                "estimable": len(unmeasured) / missed if missed else None,
                "measured": _errors(design, measured, noisy, truth, band[inside]),
                "unmeasured": _errors(design, measured, noisy, truth, unmeasured),
            }
    return out


def _errors(design: np.ndarray, measured: np.ndarray, noisy: np.ndarray, truth: np.ndarray,
            at: np.ndarray) -> dict[str, float] | None:
    return dict(zip(AXES, rms_error(design, measured, noisy, truth, at), strict=True)) if len(at) else None


def _default_measured(table: Grid, seed: int) -> list[int]:
    result = minimize(table.problem(), get_algorithm("default"), seed=seed)
    return [table.space.index_of(e.candidate) for e in result.measured]


def summarise(results: list[dict]) -> list[dict]:
    """Per grid shape (number of configurations): medians over its partition types and seeds."""
    by_shape: dict[int, list[dict]] = defaultdict(list)
    for result in results:
        by_shape[result["configurations"]].append(result)
    rows = []
    for configurations, group in sorted(by_shape.items()):
        row = {"configurations": configurations, "searches": len(group), "budget": group[0]["budget"],
               "parameters": group[0]["parameters"],
               "bias": {k: {axis: statistics.median(r["bias"][k][axis] for r in group) for axis in AXES}
                        for k in DEGREES}, "error": {}}
        for name in group[0]["error"]:
            shares = [r["error"][name]["estimable"] for r in group if r["error"][name]["estimable"] is not None]
            row["error"][name] = {"estimable": statistics.median(shares) if shares else None}
            for where in ("measured", "unmeasured"):
                values = [r["error"][name][where] for r in group if r["error"][name][where] is not None]
                row["error"][name][where] = ({axis: statistics.median(v[axis] for v in values) for axis in AXES}
                                             if values else None)
        rows.append(row)
    return rows


def _pair(values: dict | None) -> str:
    return "—" if values is None else f"{100 * values['time']:.2f} / {100 * values['effective']:.2f}"


def _share(estimable: float | None) -> str:
    return "" if estimable is None else f" ({100 * estimable:.0f} % of them estimable)"


def print_table(rows: list[dict], elapsed_s: float, searches: int) -> None:
    print(f"Search floor: {searches} searches, {elapsed_s:.0f} s; relative RMS %, time / effective energy, "
          f"medians over partition types and seeds")
    for row in rows:
        params = ", ".join(f"k={k}: {row['parameters'][k]}" for k in DEGREES)
        bias = ", ".join(f"k={k} {_pair(row['bias'][k])}" for k in DEGREES)
        print(f"{row['configurations']} configurations ({row['searches']} searches), budget n = {row['budget']}, "
              f"parameters {params}")
        print(f"  bias (noise-free fit, band): {bias}")
        for name, errors in row["error"].items():
            print(f"  {name:12s} fitted to its noisy measurements: band measured {_pair(errors['measured'])}, "
                  f"band unmeasured {_pair(errors['unmeasured'])}{_share(errors['estimable'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds per partition type (default 2)")
    parser.add_argument("--noise", type=float, default=0.01, help="relative measurement noise (default 0.01)")
    parser.add_argument("--within", type=float, default=0.01, help="the band: relative gap to the front (default 0.01)")
    parser.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--gpu", default=GPU, help=f"simulated GPU (default {GPU})")
    parser.add_argument("--models", metavar="M[,M...]", default=",".join(MODELS), help="model presets")
    parser.add_argument("--quick", action="store_true", help="two configurations instead of sixteen")
    parser.add_argument("--json", metavar="PATH", help="also write every result and the summary as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.within < 1:
        parser.error(f"--within must be between 0 and 1, got {args.within}")
    todo = cases(args.quick, args.seeds, args.noise, args.gpu, tuple(args.models.split(",")))
    started = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(pool.map(floor_case, todo, itertools.repeat(args.within)))
    else:
        results = [floor_case(case, args.within) for case in todo]
    rows = summarise(results)
    print_table(rows, time.perf_counter() - started, len(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summary": rows, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
