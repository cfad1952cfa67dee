"""What if on a cluster: a capture dataset's replicas replayed as independent Spark tasks (each replica is
its own cache), the same replay and the same curve as `whatif RUN` on one machine, for captures too large
for it. The hashes travel as exact signed longs (Spark reads the dataset's unsigned 64-bit hashes as
decimal(20,0): shifted by 2^63 they fit a long, the bijection the DuckDB path uses)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from ..whatif import CurvePoint, curve
from .whatif_capture import capture_trace
from .whatif_runs import sum_points

POINT_SCHEMA = ("replica string, policy string, keying string, capacity long, hits long, lookups long, "
                "tokens_saved long, prompt_tokens long, hit_rate double")


def spark_curve(events, policies: Sequence[str], capacities: Sequence[int]) -> list[CurvePoint]:
    """events: the capture dataset as a Spark DataFrame (`spark.read.parquet(DIR)`); the fleet's points,
    each replica replayed in a task of its own at every capacity, their hits summed (capacity per replica)."""
    from pyspark.sql import functions as F

    shift = F.lit(str(1 << 63)).cast("decimal(20,0)")
    stored = events.where("kind = 'BlockStored' AND coalesce(medium, 'GPU') = 'GPU'").select(
        "replica", "step", "event_index", "block_index",
        (F.col("block_hash") - shift).cast("long").alias("block_hash"),
        F.coalesce((F.col("parent_hash") - shift).cast("long"), F.lit(0)).alias("parent_hash"),
        F.col("parent_hash").isNull().alias("root"), F.coalesce("block_size", F.lit(16)).alias("block_size"))
    policies, capacities = list(policies), [int(c) for c in capacities]

    def replay(part: pd.DataFrame) -> pd.DataFrame:
        part = part.sort_values(["step", "event_index", "block_index"], kind="stable")
        rows = pd.DataFrame([vars(p) for p in curve(capture_trace(part), policies, capacities)])
        return rows.assign(replica=part.replica.iloc[0])

    rows = stored.groupBy("replica").applyInPandas(replay, POINT_SCHEMA).toPandas()
    per_replica = [[CurvePoint(**{k: v for k, v in r.items() if k != "replica"}) for r in g.to_dict("records")]
                   for _, g in rows.sort_values(["replica", "policy", "capacity"]).groupby("replica")]
    order = {p: i for i, p in enumerate(policies)}
    return [sum_points(list(same)) for same in zip(*[sorted(pts, key=lambda p: (order[p.policy], p.capacity))
                                                     for pts in per_replica], strict=True)]
