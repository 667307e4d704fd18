"""Adapters that run meshrl's method inside other training engines (TRL, verl)."""
