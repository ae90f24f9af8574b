"""The request path, one stage per module, in the order `gateway/pipeline.py` runs them:

authenticate -> parse (body.py reads it) -> holders (a stored response's) -> route (candidates)
-> estimate -> quota (early) -> count -> workload -> route -> place (checks.py: every pool rule)
-> quota -> admit (gateway/admit/) -> forward -> account.

The record they fill in is `gateway/context/ctx.py`.
"""
