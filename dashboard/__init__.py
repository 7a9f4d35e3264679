"""The phasewatch dashboard: reads an exporter's JSON API (or Prometheus) for the Dash app."""
