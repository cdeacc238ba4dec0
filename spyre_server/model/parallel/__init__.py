"""Tensor parallelism: one model split over ranks (processes) under one scheduler."""
