"""Human output: tables and plots of estimates and measurements."""

from memfit.report.plots import plot_before_after, plot_timeline
from memfit.report.levers import what_if_table
from memfit.report.tables import breakdown_table, verdict

__all__ = ["breakdown_table", "plot_before_after", "plot_timeline", "verdict", "what_if_table"]
