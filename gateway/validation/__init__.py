"""A client's request checked at the edge and turned into the finished AddRequest the scheduler
gets: validate.py, the bounds it checks (limits.py), beam search's and structured output's own
fields, and the one error a check raises.

Nothing is imported here.
"""
