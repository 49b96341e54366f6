"""Membership as held objects: generations and how they form, failover, joins, drains, fallback,
moving layers between members, the runtime's events, the loader's progress, and the wiring that
builds the strategy's parts.
"""
