"""Accuracy-driven mixed-precision search for INT8 variants (sensitivity analysis + budgeted search)."""
