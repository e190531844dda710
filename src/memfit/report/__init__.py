"""Human output: tables and plots of estimates and measurements."""

from memfit.report.plots import plot_timeline
from memfit.report.tables import breakdown_table, verdict

__all__ = ["breakdown_table", "plot_timeline", "verdict"]
