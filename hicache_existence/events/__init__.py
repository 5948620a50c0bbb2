"""Storage-tier KV events for routers: stores at the L3 ack, removals only when verified
(``emitter``), in SGLang's wire format (``wire``), on the package's own ZeroMQ publisher
(``zmq_sink``) or SGLang's.  See docs/kv-events.md."""
