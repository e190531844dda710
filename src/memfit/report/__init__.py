"""Human output: tables and plots of estimates and measurements."""

from memfit.report.plots import (before_after_figure, plot_before_after, plot_timeline,
                                  timeline_figure)
from memfit.report.html import write_report
from memfit.report.levers import what_if_table
from memfit.report.snapshot import snapshot, write_snapshot
from memfit.report.tables import breakdown_table, verdict

__all__ = ["before_after_figure", "breakdown_table", "plot_before_after", "plot_timeline",
           "snapshot", "timeline_figure", "verdict", "what_if_table", "write_report",
           "write_snapshot"]
