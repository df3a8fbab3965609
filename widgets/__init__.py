"""Jupyter front end: ipywidgets controls and plotly figures fed by dyspec's events."""

from widgets.dashboard import Compare, Dashboard

__all__ = ["Compare", "Dashboard"]
