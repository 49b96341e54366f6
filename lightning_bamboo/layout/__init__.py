"""The one layout model: the ownership map of a generation, cost-based stage planning, and the view
of one member's place in it that the engine reads (pure data; no Lightning).
"""
