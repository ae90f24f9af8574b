"""The request path, one stage per module, in the order `pipeline.py` runs them.

authenticate -> parse -> route (candidates) -> estimate -> quota (early) -> count -> workload
-> route -> spill -> holders -> quota -> admit (gateway/admit/) -> forward -> account.
`context.py` is the record the stages fill in.
"""
