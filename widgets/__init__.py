"""Jupyter front end: ipywidgets controls and plotly figures over dyspec's view model."""

from widgets.dashboard import Dashboard, Race, SideBySide

__all__ = ["Dashboard", "Race", "SideBySide"]
