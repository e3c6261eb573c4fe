"""End-to-end evaluation of SparseBalance against the Megatron baseline and the peers.

``arms``         the compared configurations (packing x budget policy) and their driver flags
``cluster_sim``  cluster-scale simulation: packers + DST planners + the pipeline model
``corpus``       the fixed corpus recipe of the real CPU runs
``real``         launching ``pretrain_gpt.py`` per arm and collecting its summaries
``campaign``     the real-run campaign: corpus, latency profile, arms in interleaved rounds
``stats``        throughput ratios over interleaved rounds with bootstrap intervals
``timelines``    measured per-op timelines replayed through the pipeline model
``heldout``      held-out loss at equal wall-clock (pure pieces of ``benchmarks/heldout_loss.py``)
``summary``      the one-object JSON summary (the issue's fixed shape)
``figures``      PNGs; ``report_md`` the Markdown report

The command line is ``benchmarks/compare.py``.
"""

from .arms import ARMS, FRONTIER, Arm, get_arm
from .summary import build_summary

__all__ = ["ARMS", "FRONTIER", "Arm", "build_summary", "get_arm"]
