"""Declarative mapping tables from native DeepSeek V4 names to target layouts."""
