"""The static HTML report and the module-collapsed graph layout (shared with the widgets)."""
