"""Scheduling: decides each iteration's plan and never touches tensors. The scheduler core,
the block manager, the perf model and the stage orders' cost function."""
