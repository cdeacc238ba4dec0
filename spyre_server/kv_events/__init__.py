"""KV cache events in vLLM's wire format over ZMQ, for cache-aware routers (DESIGN §4, §8).

``collector`` turns the block pool's events into wire events on the engine thread (filtering out
what must never leave the replica); ``publisher`` sends them from its own thread; ``wire`` is the
msgpack layout; ``service`` wires the three together from the ``kv_events`` configuration.
"""
