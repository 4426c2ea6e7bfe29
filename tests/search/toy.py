"""A toy cost model and prompts shared by the search tests (the tiny model's `tiny` and `simulator` fixtures are in
conftest.py)."""

from selfspec.search.costs import CostModel, SublayerCosts

PROMPTS = [[5, 9, 12, 40, 41, 7], [8, 8, 30, 2 + 4, 77, 100, 3]]
FORMATS = {"model": SublayerCosts(0.1, 0.1, 0.125), "int8": SublayerCosts(0.1, 0.05, 0.06),
           "int4-g32": SublayerCosts(0.1, 0.03, 0.035), "int4-g128": SublayerCosts(0.1, 0.028, 0.033)}
COSTS = CostModel(t_full=1.0, t_verify={m: 1.0 + 0.01 * m for m in range(2, 14)}, num_layers=4, draft=FORMATS,
                  head={16384: 0.05, 32768: 0.03, 65536: 0.02},  # the default space searches int4 heads too
                  head_low={f"{n}/int4-g{g}{r}": 0.06 + n / 1e6 - (0.005 if r else 0) for n in (0, 16384, 32768, 65536)
                            for g in (32, 128) for r in ("", "+r8")})
