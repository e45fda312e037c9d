"""Workload data shipped with neo."""
