"""The prefix scorers: what the gateway remembers sending (`prefix`) and what the replicas' own
KV-cache events say they hold (`precise_prefix`), each with its estimate of the cache hit rate.
A pool without the scorer exports none of its series."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.exporter.source import Scraped
from gateway.observability.registry import Declared

INDEX = Declared(
    GaugeMetricFamily,
    "llm_prefix_index_blocks",
    "Prompt blocks the prefix scorer remembers sending to a replica (bounded per replica).",
    ("pool", "replica"),
)
BLOCKS = Declared(
    CounterMetricFamily,
    "llm_prefix_blocks",
    "Prompt blocks of the requests sent with a prefix scorer (`sent`), and those the"
    " chosen replica had been sent before (`matched`): the gateway's estimate of the"
    " prefix-cache hit rate.",
    ("pool", "outcome"),
)
HELD = Declared(
    GaugeMetricFamily,
    "llm_kv_event_blocks",
    "Token blocks a replica's vLLM says its prefix cache holds, from its KV-cache events.",
    ("pool", "replica"),
)
EVENTS = Declared(
    CounterMetricFamily,
    "llm_kv_events",
    "KV-cache events read per replica by kind (BlockStored, BlockRemoved,"
    " AllBlocksCleared; `gap`: sequence numbers skipped, the replica's blocks dropped;"
    " `unavailable`: no endpoint to follow yet; `disconnected`: the connection lost,"
    " the replica's blocks dropped; refused: `undecodable` batches or messages,"
    " `oversize` events (by bytes or blocks) or message parts, `oversize_batch` batches"
    " of too many events (the replica's blocks dropped), `invalid` events; `unknown`).",
    ("pool", "replica", "kind"),
)
PRECISE_BLOCKS = Declared(
    CounterMetricFamily,
    "llm_precise_prefix_blocks",
    "Token blocks of the requests sent with a `precise_prefix` scorer (`sent`), and those"
    " the chosen replica's engine held when it was picked (`matched`).",
    ("pool", "outcome"),
)


class PrefixCollector(Scraped):
    declared = (INDEX, BLOCKS, HELD, EVENTS, PRECISE_BLOCKS)

    def collect(self) -> list[Metric]:
        index, blocks = INDEX(), BLOCKS()
        held, events, precise_blocks = HELD(), EVENTS(), PRECISE_BLOCKS()
        for name, pool in self.source().slots.items():
            prefix = getattr(pool.picker, "prefix", None)
            if prefix is not None:
                for replica in pool.replicas:
                    index.add_metric([name, replica.url], prefix.index.size(replica.url))
                blocks.add_metric([name, "sent"], prefix.blocks_sent)
                blocks.add_metric([name, "matched"], prefix.blocks_matched)
            precise = getattr(pool.picker, "precise", None)
            if precise is not None:
                for url, engine in list(precise.blocks.items()):
                    held.add_metric([name, url], len(engine))
                for (url, kind), count in list(precise.events.items()):
                    events.add_metric([name, url, kind], count)
                precise_blocks.add_metric([name, "sent"], precise.blocks_sent)
                precise_blocks.add_metric([name, "matched"], precise.blocks_matched)
        return [index, blocks, held, events, precise_blocks]
