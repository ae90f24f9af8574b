"""What the request path observes into: counters and histograms (`instruments.py`, declared in
`registry.py`), loop-only counters (`fast.py`), loop lag, and traces.

Below every stage, so any stage may import them; they import no stage, pool, picker or state.
What reads live state at each scrape is the exporter (gateway/exporter/), above admission.
"""
